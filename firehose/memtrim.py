"""Giving freed memory back to the operating system after a burst (a replay crowd, giant frames),
in the relay's main process and in each validation worker.

CPython hands every object over 512 bytes (event frames, store reads, socket buffers) to the C
allocator. glibc's malloc keeps what is freed inside its heaps for reuse, and the main heap only
shrinks from its top: after a crowd of replaying consumers has left, hundreds of MB stay counted
in the process's RSS although nothing uses them (measured with ``bench/replay_crowd.py``: 300
consumers over a 10,000-event window left ~140 MB behind). ``malloc_trim(0)`` returns every whole
free page of every heap (``madvise(MADV_DONTNEED)``), wherever it lies.

:class:`MemoryTrimmer` checks, every ``interval`` seconds, how many bytes malloc holds free
(``mallinfo2``: ``fordblks``, which still counts pages already given back) and trims when that
has grown by at least ``min_free`` since the last trim (or since it fell lowest) — so an idle or
steady relay never pays for it, and memory freed by a burst is given back within one interval. In
the main process (:meth:`MemoryTrimmer.run`) the trim runs in a worker thread (it releases the GIL;
the event loop goes on); a validation worker, which has no event loop, calls
:meth:`MemoryTrimmer.tick` between batches (a clock read, and a check at most once an interval).
Where the C library is not glibc (``malloc_trim`` or ``mallinfo2`` missing), :func:`glibc_trimmer`
returns None and nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("firehose.memtrim")

#: Free bytes inside malloc's heaps (grown since the last trim) worth a trim: low enough that the free
#: heap creeping up under steady load (fragmentation, ~1.7 MB/min in ``bench/soak.py``) goes back
#: too, not only what a burst freed.
DEFAULT_MIN_FREE = 8 * 1024 * 1024
DEFAULT_INTERVAL = 5.0


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
    """See the module docstring. ``libc``: a loaded glibc (``ctypes.CDLL``)."""

    def __init__(self, libc: ctypes.CDLL, *, min_free: int = DEFAULT_MIN_FREE,
                 interval: float = DEFAULT_INTERVAL) -> None:
        self._trim = libc.malloc_trim
        self._trim.argtypes = [ctypes.c_size_t]
        self._trim.restype = ctypes.c_int
        self._info = libc.mallinfo2
        self._info.argtypes = []
        self._info.restype = _MallInfo2
        self.min_free = min_free
        self.interval = interval
        self.stats = TrimStats()
        self._baseline = self.free_bytes()
        self._next_check = time.monotonic() + interval

    def free_bytes(self) -> int:
        """Bytes malloc holds free in its heaps (not given back yet)."""
        return int(self._info().fordblks)

    def trim_now(self) -> int:
        """Give back every free page; returns the RSS bytes given back. Blocking (a thread's job)."""
        before = _rss()
        self._trim(0)
        freed = max(0, before - _rss())
        self.stats.trims += 1
        self.stats.returned += freed
        return freed

    def _due(self) -> int:
        """The free bytes if they grew by ``min_free`` since the baseline, else 0."""
        free = self.free_bytes()
        self._baseline = min(self._baseline, free)  # reused since: a later burst is measured from here
        return free if free - self._baseline >= self.min_free else 0

    def _done(self, free: int, freed: int) -> int:
        self._baseline = self.free_bytes()
        log.info("memory given back", extra={"fields": {"free_mb": round(free / 2**20, 1),
                                                          "returned_mb": round(freed / 2**20, 1)}})
        return freed

    async def maybe_trim(self) -> int:
        """Trim (in a worker thread) if the free bytes grew by ``min_free``; returns what was given back."""
        free = self._due()
        return self._done(free, await asyncio.to_thread(self.trim_now)) if free else 0

    def tick(self) -> int:
        """For a process without an event loop, called often (after each unit of work): at most
        once every ``interval`` seconds, trim here and now if the free bytes grew by ``min_free``.
        Returns what was given back."""
        now = time.monotonic()
        if now < self._next_check:
            return 0
        self._next_check = now + self.interval
        try:
            free = self._due()
            return self._done(free, self.trim_now()) if free else 0
        except OSError:  # /proc unreadable: nothing to measure, try again later
            return 0

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
