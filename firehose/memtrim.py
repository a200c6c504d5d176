"""Giving freed memory back to the operating system after a burst (a replay crowd, giant frames),
in the relay's main process and in each validation worker.

CPython hands every object over 512 bytes (event frames, store reads, socket buffers) to the C
allocator. glibc's malloc keeps what is freed inside its heaps for reuse, and the main heap only
shrinks from its top: after a crowd of replaying consumers has left, hundreds of MB stay counted
in the process's RSS although nothing uses them (measured with ``bench/replay_crowd.py``: 300
consumers over a 10,000-event window left ~140 MB behind). ``malloc_trim(0)`` returns every whole
free page of every heap (``madvise(MADV_DONTNEED)``), wherever it lies.

When to trim is decided from the process's RSS (``/proc/self/statm``, a few microseconds) first:
``mallinfo2`` walks every free chunk of every heap under the heap's lock, which on a heap
fragmented by a crowd took from 0.4 ms (10,000 free chunks) to 56 ms (100,000), so it is never
called on the event loop. Its free-byte count alone is no trigger either: it also counts pages
already given back, so memory freed after a trim, once re-used and freed again, did not look new
(up to the threshold stayed resident after every burst).

:class:`MemoryTrimmer` checks, every ``interval`` seconds, how far the RSS stands above the lowest
it has been (``rest``). Only while it stands ``min_free`` or more above, a worker thread estimates
the resident free memory — RSS less malloc's live blocks (``mallinfo2``: ``uordblks + hblkhd``)
less the resident overhead no trim returns, measured after the last trim — and, when that is
``min_free`` or more, trims (``malloc_trim`` releases the GIL: the event loop goes on). So memory a
burst freed is given back within ``interval`` of the burst ending, however its frees were spread;
memory in use above rest is not asked for; a relay at rest pays one read of ``/proc``. In the
main process (:meth:`MemoryTrimmer.run`) the check and the trim run in a worker thread; a
validation worker, which has no event loop, calls :meth:`MemoryTrimmer.tick` between batches (a
clock read, and a check at most once an interval). Where the C
library is not glibc (``malloc_trim`` or ``mallinfo2`` missing), :func:`glibc_trimmer` returns
None and nothing runs.
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

#: RSS above its lowest worth a trim.
DEFAULT_MIN_FREE = 32 * 1024 * 1024
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
        #: the lowest RSS seen: what the process needs at rest
        self.rest = _rss()
        #: resident bytes that are not malloc's live blocks and no trim returns (code, CPython's
        #: small-object arenas, stacks, part-used pages): measured now and after every trim
        self.overhead = max(0, self.rest - self._in_use())
        self._next_check = time.monotonic() + interval

    def _in_use(self) -> int:
        info = self._info()
        return int(info.uordblks + info.hblkhd)

    def free_bytes(self) -> int:
        """Bytes malloc holds free in its heaps, pages already given back included. Walks every
        free chunk under the heaps' locks: a worker thread's job."""
        return int(self._info().fordblks)

    def resident_free(self) -> int:
        """Resident bytes a trim could give back: RSS less malloc's live blocks less
        :attr:`overhead`. Walks every free chunk under the heaps' locks: a worker thread's job."""
        return _rss() - self._in_use() - self.overhead

    def trim_now(self) -> int:
        """Give back every free page; returns the RSS bytes given back, and measures
        :attr:`overhead` anew (what stays resident beyond live blocks). Blocking (a thread's job)."""
        before = _rss()
        self._trim(0)
        after = _rss()
        self.overhead = max(0, after - self._in_use())
        freed = max(0, before - after)
        self.stats.trims += 1
        self.stats.returned += freed
        return freed

    def _above_rest(self) -> int:
        """The RSS if it stands ``min_free`` or more above :attr:`rest` (updated), else 0: one read
        of ``/proc``, the whole cost of a check at rest."""
        rss = _rss()
        self.rest = min(self.rest, rss)
        return rss if rss - self.rest >= self.min_free else 0

    def _check(self, rss: int) -> int:
        """Trim if at least ``min_free`` of the RSS is resident free memory (blocking: walks the
        heaps); logs what was given back and returns it."""
        if self.resident_free() < self.min_free:
            return 0
        freed = self.trim_now()
        log.info("memory given back", extra={"fields": {"rss_mb": round(rss / 2**20, 1),
                                                          "rest_mb": round(self.rest / 2**20, 1),
                                                          "returned_mb": round(freed / 2**20, 1)}})
        return freed

    async def maybe_trim(self) -> int:
        """Trim (in a worker thread) when the RSS stands ``min_free`` above :attr:`rest` and at
        least ``min_free`` of it is resident free memory; returns the bytes given back."""
        rss = self._above_rest()
        return await asyncio.to_thread(self._check, rss) if rss else 0

    def tick(self) -> int:
        """For a process without an event loop, called often (after each unit of work): at most
        once every ``interval`` seconds, the same check as :meth:`maybe_trim`, trimming here and now.
        Returns the bytes given back."""
        now = time.monotonic()
        if now < self._next_check:
            return 0
        self._next_check = now + self.interval
        try:
            rss = self._above_rest()
            return self._check(rss) if rss else 0
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
