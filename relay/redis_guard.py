"""A Redis client that stops waiting on a Redis that does not answer.

``FailFastRedis(client)`` passes ``get``/``set``/``delete`` to ``client`` (a bounded client from
``firehose.bus.redis_client``) until one of them fails as unavailable (timeout or connection
error). From then on calls raise ``RedisSkipped`` at once for ``cool_off`` seconds; after that one
call at a time is let through as a probe (the others still fail at once) until one succeeds. So a
hung Redis costs one timeout per ``cool_off``, not one per call: the identity cache in front of
every commit's key lookup (``relay.identity.RedisIdentityCache``, which falls back to its
in-process copy on any error) keeps ingest at its pace while Redis is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.exceptions as redis_errors

T = TypeVar("T")


class RedisSkipped(redis_errors.ConnectionError):
    """The call was not sent: Redis failed recently and is not being probed by this call."""


class FailFastRedis:
    """See the module docstring."""

    def __init__(self, client: Any, *, cool_off: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cool_off = cool_off
        self.clock = clock
        #: until when calls fail at once (0: Redis is answering)
        self.skip_until = 0.0
        self._probing = False

    @property
    def open(self) -> bool:
        """True while Redis is considered unavailable (calls fail fast or probe)."""
        return self.skip_until > 0

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        probe = False
        if self.skip_until:
            if self._probing or self.clock() < self.skip_until:
                raise RedisSkipped("Redis did not answer recently; call skipped")
            probe = self._probing = True
        try:
            result = await call()
        except (redis_errors.TimeoutError, redis_errors.ConnectionError, TimeoutError, OSError):
            self.skip_until = self.clock() + self.cool_off
            raise
        finally:
            if probe:
                self._probing = False
        self.skip_until = 0.0
        return result

    async def get(self, key: str) -> Any:
        return await self._call(lambda: self.client.get(key))

    async def set(self, key: str, value: Any, **kwargs: Any) -> Any:
        return await self._call(lambda: self.client.set(key, value, **kwargs))

    async def delete(self, *keys: str) -> Any:
        return await self._call(lambda: self.client.delete(*keys))
