"""Timestamp identifiers (TIDs): 64-bit (top bit 0) = 53-bit microseconds since the UNIX epoch
followed by a 10-bit clock id, written as 13 characters of base32-sortable
(``234567abcdefghijklmnopqrstuvwxyz``). Lexical order equals numeric order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from mst.errors import InvalidIdentifier
from mst.syntax import is_valid_tid

__all__ = ["TidClock", "int_to_tid", "tid_to_int", "tid_to_micros"]

_ALPHABET = "234567abcdefghijklmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(_ALPHABET)}


def int_to_tid(n: int) -> str:
    """Encode a 63-bit unsigned integer as a 13-character TID."""
    if not 0 <= n < (1 << 63):
        raise InvalidIdentifier("invalid_tid", "TID integer out of range")
    out = []
    for _ in range(13):
        out.append(_ALPHABET[n & 31])
        n >>= 5
    return "".join(reversed(out))


def tid_to_int(tid: str) -> int:
    """Decode a TID string to its integer; raises ``InvalidIdentifier('invalid_tid')``."""
    if not is_valid_tid(tid):
        raise InvalidIdentifier("invalid_tid", repr(tid)[:40])
    n = 0
    for c in tid:
        n = (n << 5) | _INDEX[c]
    return n


def tid_to_micros(tid: str) -> int:
    """The timestamp of a TID in microseconds since the UNIX epoch."""
    return tid_to_int(tid) >> 10


class TidClock:
    """Monotonic TID generator: every ``next()`` is strictly greater than the previous one,
    even if the wall clock stalls or steps backwards. ``clock_id`` is 0..1023 (random if None);
    ``now_micros`` can be injected for deterministic tests and simulations."""

    def __init__(self, clock_id: int | None = None, now_micros: Callable[[], int] | None = None) -> None:
        self.clock_id = random.randrange(1024) if clock_id is None else clock_id & 1023
        self._now = now_micros or (lambda: time.time_ns() // 1000)
        self._last = 0

    def next(self) -> str:
        """A new TID, strictly greater than any previously returned by this clock."""
        micros = max(self._now(), self._last + 1)
        self._last = micros
        return int_to_tid((micros << 10) | self.clock_id)

    def next_after(self, tid: str) -> str:
        """A new TID strictly greater than both ``tid`` and this clock's previous output."""
        self._last = max(self._last, tid_to_micros(tid))
        return self.next()
