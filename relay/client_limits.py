"""Per-client rate limits for the public endpoints one client could abuse.

``ClientRateLimiter(per_minute)`` is a token bucket per client address: each client holds up to
``per_minute`` tokens, refilled at ``per_minute / 60`` per second. ``take(client)`` spends a
token and returns 0.0, or, when the client has none, spends nothing and returns the seconds until
it has one again (the ``Retry-After``). ``wait(client)`` only looks. ``per_minute == 0`` means no
limit. The table is bounded: past ``max_clients`` addresses the least recently seen is forgotten
(it starts again with a full bucket), so memory stays flat whatever the number of clients.

A refusal is ``RateLimited(retry_after)``: an ``XrpcError`` answered ``429 RateLimitExceeded``
with a ``Retry-After`` header (whole seconds, at least 1).

The client address is the ASGI ``client`` (uvicorn rewrites it from ``X-Forwarded-For`` only for
peers it is told to trust: ``FORWARDED_ALLOW_IPS``, by default 127.0.0.1).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import Scope

from relay.xrpc import XrpcError

__all__ = ["ClientRateLimiter", "RateLimited", "client_address"]


def client_address(scope: Scope) -> str:
    """The ASGI scope's client host (``"unknown"`` when the server did not say)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class RateLimited(XrpcError):
    """429 ``RateLimitExceeded`` with ``Retry-After``."""

    def __init__(self, retry_after: float, message: str = "too many requests") -> None:
        super().__init__(429, "RateLimitExceeded", message)
        self.retry_after = max(1, math.ceil(retry_after))

    def response(self) -> JSONResponse:
        answer = super().response()
        answer.headers["retry-after"] = str(self.retry_after)
        return answer


class ClientRateLimiter:
    """See the module docstring."""

    def __init__(self, per_minute: int, *, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.max_clients = max_clients
        self._clock = clock
        #: client -> (tokens, at): the tokens it had at monotonic time ``at``
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _tokens(self, client: str, now: float) -> float:
        found = self._buckets.get(client)
        if found is None:
            return self.capacity
        tokens, at = found
        return min(self.capacity, tokens + (now - at) * self.rate)

    def wait(self, client: str) -> float:
        """Seconds until ``client`` has a token (0.0: it has one now)."""
        if not self.capacity:
            return 0.0
        tokens = self._tokens(client, self._clock())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def take(self, client: str) -> float:
        """Spend one of ``client``'s tokens (0.0), or return the seconds until it has one."""
        if not self.capacity:
            return 0.0
        now = self._clock()
        tokens = self._tokens(client, now)
        if tokens < 1.0:
            return (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens - 1.0, now)
        self._buckets.move_to_end(client)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return 0.0

    def __len__(self) -> int:
        return len(self._buckets)
