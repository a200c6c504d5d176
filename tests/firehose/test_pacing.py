"""firehose.ratelimit.TokenBucket / RateLimiter and firehose.backoff: the one token bucket and
the one backoff formula (their users' own tests cover the waiting styles)."""

from __future__ import annotations

import random

import pytest

from firehose.backoff import Backoff, backoff_delay
from firehose.ratelimit import RateLimiter, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_starts_full_refills_and_caps() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, capacity=3, clock=clock)
    for _ in range(3):
        assert bucket.delay() == 0
        bucket.take()
    assert bucket.delay() == pytest.approx(0.5)  # empty: one token in 1/rate seconds
    clock.now += 0.25
    assert bucket.delay() == pytest.approx(0.25)
    clock.now += 100
    bucket.refill()
    assert bucket.tokens == 3  # never above capacity


async def test_limiter_needs_a_token_in_every_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter([(2, 1.0), (3, 10.0), (0, 1.0)], clock=clock)  # 2/s and 3 per 10 s; n=0 is no limit
    await limiter.acquire()
    await limiter.acquire()  # (no sleep: a token was there each time)
    assert limiter.delay() == pytest.approx(0.5)  # the per-second bucket is empty
    clock.now += 1.0
    await limiter.acquire()  # the per-10-s bucket is now empty too, with 0.3 tokens earned
    assert limiter.delay() == pytest.approx((1 - 0.3) / 0.3)  # the per-10-s bucket decides
    assert limiter.waited_s == 0
    assert RateLimiter([]).delay() == 0


def test_backoff_delay_doubles_to_the_cap() -> None:
    assert [backoff_delay(a, 0.05, 5.0) for a in range(9)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert backoff_delay(3, 0.5) == 4.0  # uncapped
    assert backoff_delay(10_000, 1.0, 60.0) == 60.0  # no overflow for a long outage
    rng = random.Random(1)
    for a in range(12):
        d = backoff_delay(a, 1.0, 30.0, rng=rng)
        assert min(30, 2**a) / 2 <= d <= min(30, 2**a)


def test_backoff_state_resets() -> None:
    b = Backoff(0.1, 5.0)
    assert [b.next() for _ in range(3)] == [0.1, 0.2, 0.4]
    b.reset()
    assert b.next() == 0.1
