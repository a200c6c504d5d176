"""Coalesced lookups: many concurrent ``get(key)`` calls answered by one ``fetch(keys)`` query.

``BatchedLookup(fetch)``: lookups made in the same event-loop turn — and all those made while a
query is running — are answered by the next single ``fetch(keys) -> {key: value}`` (at most
``max_batch`` keys each; absent keys answer None). One query runs at a time, and a lookup never
joins a query that started before it, so it sees every write completed before it was made. A
failing ``fetch`` raises its exception in every lookup of that batch.

Used where a burst of never-seen accounts would otherwise cost one store round trip (one thread
hop, for SQLite) per account: account rows in the lanes, persisted identities.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BatchedLookup(Generic[K, V]):
    """See the module docstring. ``queries`` counts the ``fetch`` calls made."""

    def __init__(self, fetch: Callable[[list[K]], Awaitable[Mapping[K, V]]], *, max_batch: int = 1000) -> None:
        self.fetch = fetch
        self.max_batch = max_batch
        self.queries = 0
        self._wanted: dict[K, asyncio.Future[V | None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def get(self, key: K) -> V | None:
        future = self._wanted.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._wanted[key] = loop.create_future()
            if self._reader is None:
                self._reader = loop.create_task(self._read())
        return await asyncio.shield(future)

    async def wait_idle(self) -> None:
        """Return once no query is running or due (shutdown)."""
        while self._reader is not None:
            await asyncio.shield(self._reader)

    async def _read(self) -> None:
        try:
            await asyncio.sleep(0)  # let the rest of this loop turn add its lookups
            while self._wanted:
                keys = list(self._wanted)[: self.max_batch]
                futures = [self._wanted.pop(key) for key in keys]
                self.queries += 1
                try:
                    found = await self.fetch(keys)
                except Exception as exc:
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                            future.exception()  # retrieved here: a cancelled waiter must not leave it unseen
                    continue
                for key, future in zip(keys, futures, strict=True):
                    if not future.done():
                        future.set_result(found.get(key))
        finally:
            self._reader = None
            for future in self._wanted.values():  # only when cancelled
                future.cancel()
            self._wanted.clear()
