"""The open-file limit: the relay holds one socket per upstream host and one per consumer.

``raise_open_file_limit()`` lifts the soft ``RLIMIT_NOFILE`` to the hard limit (many systems start
processes at a soft 1,024 under a hard limit far higher: a relay would stop near 960 hosts) and
returns both values; ``hosts_allowed(limit)`` is what is left for upstream hosts after a reserve
for the database, listeners, worker pipes and logs.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

#: File descriptors kept for everything that is not an upstream host or a consumer.
RESERVED_FDS = 64


@dataclass(frozen=True, slots=True)
class FileLimit:
    before: int  # the soft limit found at start
    soft: int  # the soft limit now
    hard: int

    @property
    def raised(self) -> bool:
        return self.soft > self.before


def _nr_open() -> int:
    """The kernel's ceiling for a soft limit when the hard one is unlimited."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_file_limit() -> FileLimit:
    """Set the soft open-file limit to the hard one (idempotent; a refusal leaves it as it was)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft == resource.RLIM_INFINITY or soft >= target:
        return FileLimit(soft, soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return FileLimit(soft, soft, hard)
    return FileLimit(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)


def hosts_allowed(limit: int) -> int:
    """Upstream hosts a process with this open-file limit can follow (consumers share the rest)."""
    return max(0, limit - RESERVED_FDS)
