"""``relay.client_limits.ClientRateLimiter``: token buckets per client address, bounded."""

from __future__ import annotations

from relay.client_limits import ClientRateLimiter, RateLimited


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_spends_its_minute_then_waits_for_one_token() -> None:
    clock = Clock()
    limiter = ClientRateLimiter(60, clock=clock)  # one token back every second
    assert [limiter.take("a") for _ in range(60)] == [0.0] * 60
    assert limiter.take("a") == 1.0 and limiter.wait("a") == 1.0  # refused: nothing spent
    assert limiter.take("b") == 0.0  # another address has its own bucket
    clock.now += 0.5
    assert limiter.take("a") == 0.5
    clock.now += 0.5
    assert limiter.take("a") == 0.0 and limiter.take("a") == 1.0
    clock.now += 3600
    assert [limiter.take("a") for _ in range(61)] == [0.0] * 60 + [1.0]  # refilled to the cap, not past it


def test_zero_is_no_limit() -> None:
    limiter = ClientRateLimiter(0)
    assert all(limiter.take("a") == 0.0 for _ in range(1000)) and len(limiter) == 0


def test_the_table_is_bounded() -> None:
    limiter = ClientRateLimiter(1, max_clients=100, clock=Clock())
    for i in range(1000):
        limiter.take(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) == 100
    assert limiter.take("10.0.3.231") > 0  # among the most recent: still limited
    assert limiter.take("10.0.0.0") == 0.0  # the oldest was forgotten: a full bucket again


def test_rate_limited_answers_429_with_whole_seconds() -> None:
    response = RateLimited(0.2).response()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert RateLimited(10.01).response().headers["retry-after"] == "11"
