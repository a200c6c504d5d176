"""The queue of accounts waiting for a resync: filled by the account lanes (a broken chain, a held
account released), drained by ``relay.resync.ResyncManager``'s workers. Each DID is queued at
most once at a time (a retry re-queues it with its attempt number)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ResyncQueue:
    """``enqueue(did)`` is idempotent while the DID is pending; ``get()`` takes the next."""

    def __init__(self, on_change: Callable[[int], None] | None = None) -> None:
        """``on_change(pending)`` is called whenever the number of pending DIDs changes (a gauge)."""
        self._queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._pending: set[str] = set()
        self._on_change = on_change

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._pending))

    async def enqueue(self, did: str, attempt: int = 0) -> None:
        if did in self._pending and attempt == 0:
            return
        self._pending.add(did)
        self._changed()
        await self._queue.put((did, attempt))

    async def get(self) -> tuple[str, int]:
        return await self._queue.get()

    def done(self, did: str) -> None:
        """The DID's resync finished (or was given up): it may be queued again."""
        self._pending.discard(did)
        self._changed()
