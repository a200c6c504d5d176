"""Token-bucket rate limits applied as *backpressure* (the caller waits; nothing is dropped)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    capacity: float
    per_second: float
    tokens: float
    stamp: float


class RateLimiter:
    """Several token buckets at once, e.g. ``[(50, 1.0), (1500, 3600.0)]`` = 50 events per
    second *and* 1500 per hour. ``acquire()`` sleeps until every bucket has a token."""

    def __init__(
        self, limits: Sequence[tuple[float, float]], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        now = clock()
        self._buckets = [_Bucket(float(n), n / w, float(n), now) for n, w in limits if n > 0 and w > 0]
        self.waited_s = 0.0

    def _refill(self, now: float) -> None:
        for b in self._buckets:
            b.tokens = min(b.capacity, b.tokens + (now - b.stamp) * b.per_second)
            b.stamp = now

    def delay(self) -> float:
        """Seconds until one token is available in every bucket (0 if now)."""
        self._refill(self._clock())
        return max((0.0 if b.tokens >= 1 else (1 - b.tokens) / b.per_second) for b in self._buckets) if self._buckets else 0.0

    async def acquire(self) -> None:
        while True:
            wait = self.delay()
            if wait <= 0:
                for b in self._buckets:
                    b.tokens -= 1
                return
            self.waited_s += wait
            await asyncio.sleep(wait)
