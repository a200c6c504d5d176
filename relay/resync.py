"""Resync: repair desynchronized (or released throttled) accounts from their PDS.

A bounded pool of workers takes DIDs from a queue (each DID at most once in the queue). For
each: re-resolve the identity (fresh), fetch ``com.atproto.sync.getRepo`` from the account's PDS
through the SSRF-checked client (timeout, size limit), verify the whole repository with
``mst.verify.verify_repo_car`` (signature, every block hash, full tree walk), then hand the new
state and the ``#sync`` body (a CAR holding only the signed commit block) to
``AccountLanes.finish_resync`` (in the account's lane), which sequences it and judges the
commits buffered meanwhile.

Failures are counted under ``relay_resyncs_total{result=<reason>}`` and retried with backoff
(up to ``max_attempts``); the account stays ``desynchronized`` until a resync succeeds (or a valid
upstream ``#sync`` arrives). ``getRepoStatus`` reports ``desynchronized`` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

from backfill.collections import counts_from_paths
from backfill.store import Store
from firehose.backoff import backoff_delay
from firehose.state import AccountState
from mst.errors import ReasonError
from relay.accounts import now_iso
from relay.identity import IdentityError, IdentityResolver
from relay.jsonlog import fields
from relay.lanes import AccountLanes
from relay.metrics import RelayMetrics
from relay.repo_proxy import RepoFetchError, fetch_repo_car
from relay.resync_queue import ResyncQueue
from relay.ssrf import SafeClient

log = logging.getLogger("relay.resync")

MAX_REPO_BYTES = 512 * 1024 * 1024


class ResyncFailed(ReasonError):
    """A repair attempt that did not succeed; ``reason`` is the metric label."""

    show_reason = False


class ResyncManager:
    """Worker pool over a ``ResyncQueue``; completed repairs go to the account's lane."""

    def __init__(self, *, store: Store, identity: IdentityResolver, safe: SafeClient, metrics: RelayMetrics,
                 queue: ResyncQueue, lanes: AccountLanes, workers: int = 4,
                 max_attempts: int = 5, retry_base: float = 2.0, max_repo_bytes: int = MAX_REPO_BYTES) -> None:
        self.store = store
        self.identity = identity
        self.safe = safe
        self.metrics = metrics
        self.queue = queue
        self.lanes = lanes
        self.workers = max(1, workers)
        self.max_attempts = max_attempts
        self.retry_base = retry_base
        self.max_repo_bytes = max_repo_bytes
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start the workers and requeue accounts left desynchronized by a previous run."""
        self._tasks = [asyncio.create_task(self._worker(), name=f"resync-{i}") for i in range(self.workers)]
        for sync_state in ("desynchronized", "resyncing"):
            for state in await self.store.accounts_by_sync_state(sync_state, limit=100_000):
                await self.queue.enqueue(state.did)

    async def close(self) -> None:
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
            await self.store.set_host_status(hostname, "active")
        return count

    async def _worker(self) -> None:
        while True:
            did, attempt = await self.queue.get()
            try:
                await self.resync_one(did)
                self.metrics.resyncs.labels(result="ok").inc()
                self.queue.done(did)
            except ResyncFailed as exc:
                self.metrics.resyncs.labels(result=exc.reason).inc()
                log.info("resync failed", extra=fields(did=did, reason=exc.reason, attempt=attempt,
                                                       error=str(exc)))
                if attempt + 1 < self.max_attempts:
                    asyncio.get_running_loop().call_later(backoff_delay(attempt, self.retry_base), self._retry,
                                                          did, attempt + 1)
                else:
                    self.queue.done(did)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.resyncs.labels(result="internal_error").inc()
                log.exception("resync crashed", extra=fields(did=did))
                self.queue.done(did)

    def _retry(self, did: str, attempt: int) -> None:
        asyncio.ensure_future(self.queue.enqueue(did, attempt))

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
        commit_cid = verified.commit_cid
        sync_car = write_car([commit_cid], [(commit_cid, bytes(verified.blocks[commit_cid]))])
        # synced (the default); ``updated_at`` is set when it is written
        new_state = AccountState(did=did, host=ident.pds_hostname, rev=commit.rev, commit_cid=commit_cid.encode(),
                                 data_cid=commit.data.encode())
        body = {"did": did, "rev": commit.rev, "blocks": sync_car, "time": now_iso()}
        await self.lanes.finish_resync(did, new_state, body, counts_from_paths(verified.records))
        log.info("resynced", extra=fields(did=did, rev=commit.rev, records=len(verified.records)))
