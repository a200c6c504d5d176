"""Resync: repair desynchronized (or released throttled) accounts from their PDS.

A bounded pool of workers takes DIDs from a queue (each DID at most once in the queue). For
each: re-resolve the identity (fresh), fetch ``com.atproto.sync.getRepo`` from the account's PDS
through the SSRF-checked client (timeout, size limit), verify the whole repository with
``mst.verify.verify_repo_car`` (signature, every block hash, full tree walk), then hand the new
state and the ``#sync`` body (a CAR holding only the signed commit block) to
``AccountLanes.finish_resync`` (in the account's lane), which sequences it and judges the
commits buffered meanwhile.

Failures are counted under ``relay_resyncs_total{result=<reason>}`` and retried for as long as
they fail: capped exponential backoff with jitter (``retry_base`` doubling up to ``retry_max``,
each delay uniform in its upper half), brought forward when the account's host sends anything
new for it (``ResyncQueue.kick``). The account stays ``desynchronized`` until a resync succeeds
(or a Spark repair clears it, or, in lenient mode, a valid upstream ``#sync`` arrives);
``getRepoStatus`` reports ``desynchronized`` meanwhile.
An entry whose account is no longer desynchronized when its turn comes (repaired otherwise)
leaves the queue without a fetch (``relay_resyncs_total{result="not_needed"}``).

``relay_desynchronized_accounts{age}`` counts the queue's accounts by how long they have been
desynchronized, ``relay_resync_held_bytes`` the bytes held for them (``relay.metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from backfill.collections import counts_from_paths
from backfill.store import Store
from firehose.backoff import backoff_delay
from firehose.state import AccountState
from mst.errors import ReasonError
from relay.accounts import now_iso
from relay.identity import IdentityError, IdentityResolver
from relay.ingest.lanes import AccountLanes
from relay.ingest.resync_queue import ResyncQueue
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.repo_proxy import RepoFetchError, fetch_repo_car
from relay.ssrf import SafeClient

log = logging.getLogger("relay.ingest.resync")

MAX_REPO_BYTES = 512 * 1024 * 1024


class ResyncFailed(ReasonError):
    """A repair attempt that did not succeed; ``reason`` is the metric label."""

    show_reason = False


class ResyncManager:
    """Worker pool over a ``ResyncQueue``; completed repairs go to the account's lane."""

    def __init__(self, *, store: Store, identity: IdentityResolver, safe: SafeClient, metrics: RelayMetrics,
                 queue: ResyncQueue, lanes: AccountLanes, workers: int = 4,
                 retry_base: float = 2.0, retry_max: float = 30.0, max_repo_bytes: int = MAX_REPO_BYTES,
                 rng: random.Random | None = None,
                 set_host_status: Callable[[str, str], Awaitable[bool]] | None = None) -> None:
        """``retry_base``/``retry_max``: the first retry's delay and the cap of the doubling delays.
        ``set_host_status``: how a host's status is changed (``relay.hosts.HostBoard.set_status``,
        which keeps the in-memory host board current; the store's own by default)."""
        self.store = store
        self.set_host_status = set_host_status or store.set_host_status
        self.identity = identity
        self.safe = safe
        self.metrics = metrics
        self.queue = queue
        self.lanes = lanes
        self.workers = max(1, workers)
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.max_repo_bytes = max_repo_bytes
        self.rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []
        metrics.watch_resyncs(queue)

    async def start(self) -> None:
        """Start the workers and requeue accounts left desynchronized by a previous run."""
        self._tasks = [asyncio.create_task(self._worker(), name=f"resync-{i}") for i in range(self.workers)]
        for sync_state in ("desynchronized", "resyncing"):
            for state in await self.store.accounts_by_sync_state(sync_state, limit=100_000):
                await self.queue.enqueue(state.did, since=state.updated_at or None)

    async def close(self) -> None:
        self.queue.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    async def release_throttled(self, hostname: str) -> int:
        """Queue every throttled account of ``hostname`` (its limit was raised)."""
        count = 0
        for state in await self.store.accounts_by_sync_state("throttled", limit=100_000):
            if state.host == hostname:
                await self.lanes.mark_for_resync(state.did, hostname)
                count += 1
        host = await self.store.get_host(hostname)
        if host is not None and host.status == "throttled":
            await self.set_host_status(hostname, "active")
        return count

    async def _worker(self) -> None:
        while True:
            did = await self.queue.get()
            try:
                result = await self._attempt(did)
            except asyncio.CancelledError:
                raise
            except ResyncFailed as exc:
                self._failed(did, exc.reason, exc.message)
                continue
            except Exception as exc:
                log.exception("resync crashed", extra=fields(did=did))
                self._failed(did, "internal_error", f"{type(exc).__name__}: {exc}")
                continue
            self.metrics.resyncs.labels(result=result).inc()
            self.queue.succeeded(did)

    async def _attempt(self, did: str) -> str:
        """One attempt for a queued account: ``ok``, or ``not_needed`` when it is no longer
        desynchronized (repaired by an upstream ``#sync`` or a Spark run, or taken out of the store)."""
        stored = await self.store.get_account(did)
        if stored is None or stored.sync_state not in ("desynchronized", "resyncing"):
            return "not_needed"
        await self.resync_one(did)
        return "ok"

    def _failed(self, did: str, reason: str, error: str) -> None:
        """Count a failed attempt and schedule the next one (capped exponential backoff, jittered)."""
        self.metrics.resyncs.labels(result=reason).inc()
        entry = self.queue.entry(did)
        attempt = entry.attempts if entry is not None else 0
        delay = backoff_delay(attempt, self.retry_base, self.retry_max, rng=self.rng)
        self.queue.failed(did, reason, error, delay)
        log.info("resync failed", extra=fields(did=did, reason=reason, attempt=attempt, error=error,
                                               retry_in=round(delay, 3)))

    async def resync_one(self, did: str) -> None:
        """Fetch, verify and install the current repository of ``did``: from the PDS its DID
        document names now (resolved fresh, so a rotated key or a move is seen), verified whole
        against that document's key, refused when older than the stored rev. The installed state
        is the account's on that PDS; its statuses stay the lane's (``finish_resync``)."""
        from mst.car import write_car
        from mst.crypto import parse_did_key
        from mst.verify import verify_repo_car

        try:
            ident = await self.identity.resolve(did, fresh=True)
        except IdentityError as exc:
            raise ResyncFailed(f"identity_{exc.reason}", str(exc)) from None
        if not ident.pds:
            raise ResyncFailed("no_pds", "the DID document names no PDS")
        try:
            car = await fetch_repo_car(self.safe, ident.pds, did, max_bytes=self.max_repo_bytes)
        except RepoFetchError as exc:
            raise ResyncFailed(exc.reason, exc.message) from None
        try:
            verified = await asyncio.to_thread(verify_repo_car, car, did, parse_did_key(ident.signing_key))
        except ReasonError as exc:  # every verification failure below mst is typed (anything else
            raise ResyncFailed(exc.reason, str(exc)) from None  # is a fault: internal_error)
        commit = verified.commit
        stored = await self.store.get_account(did)
        if stored is not None and stored.rev and commit.rev < stored.rev:
            raise ResyncFailed("repo_older_than_stored", f"PDS rev {commit.rev} < stored {stored.rev}")
        head = self.lanes.state(did)  # newer still in memory (lenient mode passes commits meanwhile)
        if head is not None and head.rev and commit.rev < head.rev:
            raise ResyncFailed("repo_older_than_stored", f"PDS rev {commit.rev} < stored {head.rev}")
        commit_cid = verified.commit_cid
        sync_car = write_car([commit_cid], [(commit_cid, bytes(verified.blocks[commit_cid]))])
        # synced (the default); ``updated_at`` is set when it is written
        new_state = AccountState(did=did, host=ident.pds_hostname, rev=commit.rev, commit_cid=commit_cid.encode(),
                                 data_cid=commit.data.encode())
        body = {"did": did, "rev": commit.rev, "blocks": sync_car, "time": now_iso()}
        if not await self.lanes.finish_resync(did, new_state, body, counts_from_paths(verified.records)):
            raise ResyncFailed("repo_older_than_stored", f"PDS rev {commit.rev} < the rev passed meanwhile")
        log.info("resynced", extra=fields(did=did, rev=commit.rev, records=len(verified.records)))
