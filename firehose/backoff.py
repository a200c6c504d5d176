"""Capped exponential backoff: the one formula behind every retry loop.

``backoff_delay(attempt, base, cap)`` is ``min(cap, base * 2**attempt)`` (``attempt`` counts from
0: the first retry waits ``base``). With ``rng`` it is "equal jitter": uniform in ``[d/2, d]``
(``d/2 + rng.uniform(0, d/2)``), so many clients failing together do not retry together.

``Backoff(base, cap)`` is a retry loop's state: ``next()`` returns the current delay and doubles
the next one (up to ``cap``); ``reset()`` after a success starts again from ``base``.

Users (and their settings): ``firehose.subscriber`` reconnects (jittered, ``backoff_base`` /
``backoff_max``, attempt reset by a connection that delivered frames), ``firehose.workers``
worker respawn (0.05 s → 5 s), ``firehose.broadcast`` failed bus reads (0.1 s → 5 s, reset on a
read), ``spark.fetch`` retried GETs (``backoff_s``, uncapped: few retries).
"""

from __future__ import annotations

import math
import random

__all__ = ["Backoff", "backoff_delay"]

_MAX_EXPONENT = 62  # base * 2**62 outlasts any cap; keeps the integer small


def backoff_delay(attempt: int, base: float, cap: float = math.inf, *, rng: random.Random | None = None) -> float:
    """``min(cap, base * 2**attempt)``; with ``rng``, uniform in ``[d/2, d]`` instead of ``d``."""
    delay = min(cap, base * (1 << min(max(attempt, 0), _MAX_EXPONENT)))
    if rng is None:
        return delay
    return delay / 2 + rng.uniform(0, delay / 2)


class Backoff:
    """See the module docstring."""

    __slots__ = ("base", "cap", "rng", "attempt")

    def __init__(self, base: float, cap: float = math.inf, *, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.rng = rng
        self.attempt = 0

    def next(self) -> float:
        """The delay before the next retry (each call doubles the following one, up to ``cap``)."""
        delay = backoff_delay(self.attempt, self.base, self.cap, rng=self.rng)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """After a success: the next delay is ``base`` again."""
        self.attempt = 0
