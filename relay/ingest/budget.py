"""A memory budget in bytes shared by many takers, granted first come, first served.

The host runs take a frame's cost before they dispatch it and give it back when the frame is done
(``relay.ingest.hostruns``). A taker that does not fit waits in line; giving bytes back wakes only
the takers at the head of the line that now fit — never every waiter (with thousands of hosts
waiting, waking them all on every finished frame would cost more than the frames). A take larger
than the whole budget is granted when nothing else is taken, so it cannot wait forever.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """``take(n)`` waits until ``n`` bytes fit under ``limit`` (in arrival order); ``give(n)``
    returns them. ``used`` is what is taken now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._line: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    async def take(self, n: int) -> None:
        if not self._line and self._fits(n):
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line.append((n, fut))
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
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        line = self._line
        while line:
            n, fut = line[0]
            if fut.done():  # its taker was cancelled
                line.popleft()
                continue
            if not self._fits(n):
                return
            line.popleft()
            self.used += n
            fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Takers in line."""
        return sum(1 for _, fut in self._line if not fut.done())
