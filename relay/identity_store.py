"""Persisted identities between the identity caches and the network (table ``identities``).

``PersistedIdentities(store)`` is the one owner of this process's identity writes:

* ``get(did)`` — read-through for a cache miss. Lookups made in the same event-loop turn (and
  while one batch is being read) share one query (``Store.get_identities`` through
  ``relay.batched.BatchedLookup``), so a burst of never-seen accounts costs one round trip per
  batch, not one per account.
* ``put(identity)`` — write-behind: queued and written in batches (``flush_interval``). A queued
  write lost in a crash costs one re-resolution after the restart, nothing else.
* ``purge(did, at)`` — an ``#identity`` (or a vanished DID) must never be answered with the old
  row again: the purge is queued like a write and then flushed at once (concurrent purges share
  one flush). Until it is stored — also while the store is unreachable — the queued purge hides
  the row from this process's reads; a purge that never lands (the process died first) leaves a
  row whose key or PDS may be outdated, which signature failures and host-binding checks
  re-resolve fresh anyway.

Queued writes are read back before the store (the store is at most ``flush_interval`` behind
this process). Writes are ordered: one flush at a time, newest write per DID, and the store keeps
a row only if it is not older than the stored one (``backfill.identities``). Store errors never
reach callers: a failed read is a miss (the DID is resolved from the network), a failed flush is
retried with backoff, keeping at most ``max_pending`` queued identities (purges are always kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from backfill.identities import Identity, IdentityPurge, IdentityWrite
from backfill.store import Store
from firehose.backoff import Backoff
from relay.batched import BatchedLookup
from relay.jsonlog import fields

log = logging.getLogger("relay.identity_store")

#: DIDs per ``Store.get_identities`` query
READ_BATCH = 1000


class PersistedIdentities:
    """See the module docstring. ``start()`` runs the write-behind task; ``close()`` flushes."""

    def __init__(self, store: Store, *, flush_interval: float = 0.2, max_pending: int = 50_000) -> None:
        self.store = store
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.flushes = 0  # successful flushes
        self._pending: dict[str, IdentityWrite] = {}
        self._flushing: dict[str, IdentityWrite] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._reads: BatchedLookup[str, Identity | None] = BatchedLookup(self._fetch, max_batch=READ_BATCH)
        self._task: asyncio.Task[None] | None = None
        self._failing = ""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="identity-write-behind")

    async def close(self) -> None:
        """Stop the write-behind task and flush what is queued (best effort: the store may be down)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._reads.wait_idle()
        await self.flush()

    # -- reads -------------------------------------------------------------------------------
    def _queued(self, did: str) -> IdentityWrite | None:
        return self._pending.get(did) or self._flushing.get(did)

    async def get(self, did: str) -> Identity | None:
        """The stored (or queued) identity of ``did``, whatever its age; None when there is none,
        it was purged, or the store could not be read."""
        queued = self._queued(did)
        if queued is not None:
            return queued if isinstance(queued, Identity) else None
        found = await self._reads.get(did)
        queued = self._queued(did)  # written (or purged) while the read was in flight: newer
        if queued is not None:
            return queued if isinstance(queued, Identity) else None
        return found

    @property
    def reads(self) -> int:
        """Store queries made by ``get``."""
        return self._reads.queries

    async def _fetch(self, dids: list[str]) -> dict[str, Identity | None]:
        try:
            return await self.store.get_identities(dids)
        except Exception as exc:  # a miss: the DIDs are resolved from the network
            self._report("read", exc)
            return {}

    # -- writes ------------------------------------------------------------------------------
    def put(self, identity: Identity) -> None:
        """Queue ``identity`` for the next flush (replacing a queued write of the same DID)."""
        self._pending[identity.did] = identity
        if len(self._pending) > self.max_pending:
            self._shed()
        self._wake.set()

    async def purge(self, did: str, at: float) -> None:
        """Make the stored identity of ``did`` a miss as of ``at``; returns once stored (or, if
        the store cannot be written now, once queued for retry — hidden from reads meanwhile)."""
        self._pending[did] = IdentityPurge(did, at)
        await self.flush()

    def _shed(self) -> None:
        """Drop the oldest queued identities beyond ``max_pending`` (each costs a re-resolution
        after a restart); queued purges are never dropped."""
        excess = len(self._pending) - self.max_pending
        for did in [d for d, w in self._pending.items() if isinstance(w, Identity)][:excess]:
            del self._pending[did]

    async def flush(self) -> bool:
        """Write everything queued (one transaction); False (and kept queued) on a store error."""
        async with self._lock:
            if not self._pending:
                return True
            self._flushing, self._pending = self._pending, {}
            try:
                await self.store.write_identities(list(self._flushing.values()))
            except BaseException as exc:  # cancelled too (close() during a flush): keep them queued
                for did, write in self._flushing.items():  # newer queued writes win
                    self._pending.setdefault(did, write)
                if not isinstance(exc, Exception):
                    raise
                self._report("write", exc)
                return False
            finally:
                self._flushing = {}
            self.flushes += 1
            if self._failing:
                log.info("identity store available again")
                self._failing = ""
            return True

    async def _run(self) -> None:
        backoff = Backoff(self.flush_interval, 30.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_interval)  # gather a batch
            if await self.flush():
                backoff.reset()
            else:
                await asyncio.sleep(backoff.next())
                self._wake.set()

    def _report(self, what: str, exc: Exception) -> None:
        message = f"{what}: {type(exc).__name__}: {exc}"[:300]
        if message != self._failing:
            log.warning("identity store unavailable: resolving from the network, writes queued",
                        extra=fields(error=message, queued=len(self._pending) + len(self._flushing)))
        self._failing = message
