"""A memory budget in bytes shared by many takers, granted in line.

The ingest host runs take a frame's cost before they dispatch it and give it back when the frame
is done (``relay.ingest.hostruns``); replaying consumers take each store read's size
(``firehose.broadcast.ReplayBudget``). A taker that does not fit waits in line; giving bytes back
wakes only the takers at the head of the line that now fit — never every waiter (with thousands of
hosts waiting, waking them all on every finished frame would cost more than the frames). A take
larger than the whole budget is granted when nothing else is taken, so it cannot wait forever.

A budget may have several lines (``lines=``): takes in an earlier line go before every take in a
later one, each line in arrival order, and the head of the first non-empty line is never
overtaken. Event-loop code only.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """``take(n)`` waits until ``n`` bytes fit under ``limit`` (in arrival order); ``give(n)``
    returns them. ``used`` is what is taken now."""

    def __init__(self, limit: int, *, lines: int = 1) -> None:
        self.limit = limit
        self.used = 0
        self._lines: tuple[deque[tuple[int, asyncio.Future[None]]], ...] = tuple(deque() for _ in range(lines))

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    def _add(self, n: int) -> None:
        """``used`` changes by ``n`` (a subclass may note it)."""
        self.used += n

    def _waits(self) -> None:
        """A take is about to wait in line (a subclass may note it)."""

    def take_now(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now and nobody waits in line (True); else take nothing
        (False: ``take`` waits in line for them)."""
        if not any(self._lines) and self._fits(n):
            self._add(n)
            return True
        return False

    async def take(self, n: int, *, line: int = 0) -> None:
        if not any(self._lines) and self._fits(n):
            self._add(n)
            return
        self._waits()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lines[line].append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled before it resumed
                self.give(n)
            else:
                fut.cancel()
                self._grant()  # it may have been the head of the line
            raise

    def give(self, n: int) -> None:
        self._add(-n)
        self._grant()

    def _grant(self) -> None:
        for line in self._lines:
            while line:
                n, fut = line[0]
                if fut.done():  # its taker was cancelled
                    line.popleft()
                    continue
                if not self._fits(n):
                    return  # the head waits for room; nobody behind it goes first
                line.popleft()
                self._add(n)
                fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Takers in line."""
        return sum(1 for line in self._lines for _, fut in line if not fut.done())
