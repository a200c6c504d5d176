"""Giving freed memory back to the operating system after a burst (a replay crowd, giant frames).

CPython hands every object over 512 bytes (event frames, store reads, socket buffers) to the C
allocator. glibc's malloc keeps what is freed inside its heaps for reuse, and the main heap only
shrinks from its top: after a crowd of replaying consumers has left, hundreds of MB stay counted
in the process's RSS although nothing uses them (measured with ``bench/replay_crowd.py``: 300
consumers over a 10,000-event window left ~140 MB behind). ``malloc_trim(0)`` returns every whole
free page of every heap (``madvise(MADV_DONTNEED)``), wherever it lies.

When to trim is read from the process's RSS (``/proc/self/statm``, a few microseconds), not
from malloc's own counters: ``mallinfo2`` walks every free chunk of every heap under the heap's
lock, which on a heap fragmented by a crowd took from 0.4 ms (10,000 free chunks) to 56 ms
(100,000) of the event loop per look; and its free-byte count also counts pages already given
back, so memory freed after a trim, once re-used and freed again, did not look new: up to the
threshold stayed resident after every burst.

:class:`MemoryTrimmer` checks, every ``interval`` seconds, how far the RSS stands above the lowest
it has been (``rest``). While it stands ``min_free`` or more above, it trims (in a worker thread:
the trim releases the GIL, the event loop goes on), at once after a trim that gave back at least
``min_free / 4``, otherwise at doubling spacing up to ``max_interval`` (memory held by live data
is not asked for every few seconds). So memory a burst freed is given back within ``interval`` of
the burst ending, however the burst's frees were spread; an idle relay at rest never pays for a
trim, and one whose RSS grew for good (caches) pays one trim per ``max_interval``. Where the C
library is not glibc (``malloc_trim`` missing), :func:`glibc_trimmer` returns None and nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("relay.memtrim")

#: RSS above its lowest worth a trim.
DEFAULT_MIN_FREE = 32 * 1024 * 1024
DEFAULT_INTERVAL = 5.0
#: Longest spacing of trims that give back little while the RSS stays up.
DEFAULT_MAX_INTERVAL = 300.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@dataclass(slots=True)
class TrimStats:
    trims: int = 0
    #: RSS bytes given back by the trims (as ``/proc/self/statm`` saw it before and after)
    returned: int = 0


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryTrimmer:
    """See the module docstring. ``libc``: a loaded glibc (``ctypes.CDLL``); ``rss``: reads this
    process's resident bytes; ``clock``: monotonic seconds (both replaceable for tests)."""

    def __init__(self, libc: ctypes.CDLL, *, min_free: int = DEFAULT_MIN_FREE,
                 interval: float = DEFAULT_INTERVAL, max_interval: float = DEFAULT_MAX_INTERVAL,
                 rss: Callable[[], int] = _rss, clock: Callable[[], float] = time.monotonic) -> None:
        self._trim = libc.malloc_trim
        self._trim.argtypes = [ctypes.c_size_t]
        self._trim.restype = ctypes.c_int
        self._info = libc.mallinfo2
        self._info.argtypes = []
        self._info.restype = _MallInfo2
        self.min_free = min_free
        self.interval = interval
        self.max_interval = max_interval
        self.stats = TrimStats()
        self._rss = rss
        self._clock = clock
        #: the lowest RSS seen: what the process needs at rest
        self.rest = rss()
        #: spacing to the next trim while the RSS stays up; no trim before ``_next_at``
        self._spacing = interval
        self._next_at = clock()

    def free_bytes(self) -> int:
        """Bytes malloc holds free in its heaps, pages already given back included (walks every
        free chunk under the heaps' locks: a diagnostic, not for the event loop)."""
        return int(self._info().fordblks)

    def trim_now(self) -> int:
        """Give back every free page; returns the RSS bytes given back. Blocking (a thread's job)."""
        before = self._rss()
        self._trim(0)
        freed = max(0, before - self._rss())
        self.stats.trims += 1
        self.stats.returned += freed
        return freed

    async def maybe_trim(self) -> int:
        """Trim (in a worker thread) when the RSS stands ``min_free`` above :attr:`rest` and the
        spacing allows; returns the bytes given back (0 when no trim ran)."""
        rss = self._rss()
        if rss < self.rest:
            self.rest = rss
        if rss - self.rest < self.min_free:
            self._spacing = self.interval  # at rest: the next burst is trimmed promptly
            return 0
        now = self._clock()
        if now < self._next_at:
            return 0
        freed = await asyncio.to_thread(self.trim_now)
        if freed >= self.min_free // 4:
            self._spacing = self.interval
        else:  # what stands above rest is in use: ask less often
            self._spacing = min(self.max_interval, self._spacing * 2)
        self._next_at = self._clock() + self._spacing
        log.info("memory given back", extra={"fields": {"rss_mb": round(rss / 2**20, 1),
                                                          "rest_mb": round(self.rest / 2**20, 1),
                                                          "returned_mb": round(freed / 2**20, 1)}})
        return freed

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.maybe_trim()
            except OSError:  # /proc unreadable: nothing to measure, try again later
                log.debug("memory trim skipped", exc_info=True)


def glibc_trimmer(**kwargs: float) -> MemoryTrimmer | None:
    """A trimmer over this process's glibc, or None when the C library has no ``malloc_trim``/``mallinfo2``."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - looked up to learn whether it exists
        libc.mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        return None
    return MemoryTrimmer(libc, **kwargs)  # type: ignore[arg-type]
