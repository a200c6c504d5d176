"""Token buckets: the one implementation, and the limiter built on it.

``TokenBucket(rate, capacity)`` is the arithmetic only (no waiting, no locking): it holds up to
``capacity`` tokens, refilled continuously at ``rate`` per second and starting full; ``delay()``
is the seconds until one token is there (0 if now), ``take()`` spends one. Every rate limit in
the code base is this bucket with a different way of waiting:

* :class:`RateLimiter` (here) — several buckets at once, async, *backpressure*: the caller
  sleeps until every bucket has a token; nothing is dropped or refused. Waiters are not queued:
  each re-checks after its sleep (the upstream subscriber has one caller per limiter).
* ``relay.identity.TokenBucket`` — one bucket, async, callers served FIFO (one sleeps at a
  time, holding a lock), and a wait longer than ``max_wait`` is *refused*
  (``IdentityError("rate_limited")``) instead of waited out.
* ``spark.fetch.TokenBucket`` — one bucket, blocking and thread-safe (Spark task threads): a
  ``threading.Lock`` around the arithmetic, the sleep outside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

__all__ = ["RateLimiter", "TokenBucket"]


class TokenBucket:
    """See the module docstring. ``rate`` must be > 0."""

    __slots__ = ("rate", "capacity", "tokens", "stamp", "clock")

    def __init__(self, rate: float, capacity: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.capacity = float(capacity)
        self.tokens = float(capacity)
        self.clock = clock
        self.stamp = clock()

    def refill(self, now: float | None = None) -> None:
        """Add the tokens earned since the last refill (up to ``capacity``)."""
        if now is None:
            now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def delay(self, now: float | None = None) -> float:
        """Seconds until one token is available (0 if now), after a refill."""
        self.refill(now)
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate

    def take(self) -> None:
        """Spend one token (call after :meth:`delay` returned 0, or after sleeping it)."""
        self.tokens -= 1.0


class RateLimiter:
    """Several token buckets at once, e.g. ``[(50, 1.0), (1500, 3600.0)]`` = 50 events per
    second *and* 1500 per hour (each bucket: capacity ``n``, rate ``n / window``; entries with
    ``n <= 0`` or ``window <= 0`` are no limit). ``acquire()`` sleeps until every bucket has a
    token, then takes one from each."""

    def __init__(
        self, limits: Sequence[tuple[float, float]], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._buckets = [TokenBucket(n / w, n, clock=clock) for n, w in limits if n > 0 and w > 0]
        self.waited_s = 0.0

    def delay(self) -> float:
        """Seconds until one token is available in every bucket (0 if now)."""
        if not self._buckets:
            return 0.0
        now = self._clock()
        return max(b.delay(now) for b in self._buckets)

    def take_now(self) -> bool:
        """Take a token from every bucket if each has one now (True); else take none (False:
        ``acquire`` waits for them)."""
        if not self._buckets:
            return True
        if self.delay() > 0:
            return False
        for b in self._buckets:
            b.take()
        return True

    async def acquire(self) -> None:
        while True:
            wait = self.delay()
            if wait <= 0:
                for b in self._buckets:
                    b.take()
                return
            self.waited_s += wait
            await asyncio.sleep(wait)
