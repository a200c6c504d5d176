"""Ingest: upstream frames → identity and host binding → validation → the sequencer.

One ``HostSubscriber`` (``firehose.subscriber``) per active host feeds ``on_frame`` in upstream
order. For each frame:

* ``#commit`` / ``#sync``: the account's DID is resolved (cached) and must be hosted by the host
  that sent the frame; on a mismatch the identity is re-resolved once (this also follows account
  migrations) and the frame is rejected (``wrong_host``) if it still does not match. Accounts over
  the host's account limit are held as ``throttled`` (state kept, nothing redistributed, resynced
  when the limit is raised). Inactive accounts (upstream status or local takedown) are not
  redistributed. Otherwise ``firehose.validate`` judges the frame against the account's state:
  accept → sequenced with the new state; ignore/reject → counted under their reason; desync →
  the account is marked ``desynchronized`` and queued for ``relay.resync``. Commits arriving while
  an account is being resynchronized are buffered and judged after the resync (``finish_resync``).
* ``#identity``: the identity cache entry is purged and re-resolved; the handle is passed on only
  when it resolves back to the DID.
* ``#account``: checked against a fresh DID document (a host the account left cannot change
  its status); the upstream status is stored; the relay emits ``#account`` with the combined
  status (a local takedown wins).

Ordering and concurrency: the preparation of a frame (the steps above that need the network or
the store) runs in a per-account task that takes that account's frames in order, so different
accounts proceed concurrently; ``firehose.pipeline`` validates in worker processes, again in
order per account; a per-host drainer takes the results strictly in upstream order and hands
them to the sequencer, so events leave in the order the host sent them.

Account state is kept in a bounded in-memory map (write-through to the store via the sequencer)
so consecutive commits of one account are judged against the newest state even before the
previous one is durable. The upstream cursor advances only when the sequencer has made the
frame's effects durable (``HostSubscriber.ack`` after the sequencer resolves).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from backfill.sequencer import Sequencer
from backfill.store import Store
from backfill.types import HostState
from firehose.pipeline import ValidationPipeline
from firehose.state import AccountState, PendingEvent
from firehose.subscriber import HostSubscriber, SubscriberConfig, UpstreamFrame
from firehose.validate import outgoing_body
from mst.syntax import is_valid_did
from relay.accounts import account_event_body
from relay.config import RelayConfig
from relay.hosts import HostManager, host_base_url
from relay.identity import Identity, IdentityError, IdentityResolver
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.ssrf import split_host_port

log = logging.getLogger("relay.ingest")

#: Frames buffered per account while it is being resynchronized (older ones are covered by it).
MAX_BUFFER_PER_ACCOUNT = 1000
#: ``PendingEvent.body`` of a pre-encoded event (the sequencer does not read it); never mutated.
_NO_BODY: dict[str, Any] = {}
UNTRUSTED_RATE_LIMITS = [(500.0, 1.0), (500_000.0, 3600.0), (5_000_000.0, 86400.0)]


def _did_of(kind: str, body: dict[str, Any]) -> str | None:
    did = body.get("repo") if kind == "#commit" else body.get("did")
    return did if isinstance(did, str) and is_valid_did(did) else None


@dataclasses.dataclass(slots=True)
class _Item:
    """One upstream frame on its way through a host's reorder queue."""

    hostname: str
    uf: UpstreamFrame
    kind: str
    received: float
    did: str | None = None
    state: AccountState | None = None
    signing_key: str | None = None
    verdict: asyncio.Future[Any] | None = None
    event: PendingEvent | None = None
    prep: asyncio.Future[None] | None = None


@dataclasses.dataclass(slots=True)
class _HostRun:
    subscriber: HostSubscriber
    task: asyncio.Task[None]
    last_frame: float = 0.0


class Ingest:
    """Owns the upstream subscribers and the per-account judgement."""

    def __init__(self, *, store: Store, sequencer: Sequencer, identity: IdentityResolver,
                 hosts: HostManager, metrics: RelayMetrics, config: RelayConfig,
                 pipeline: ValidationPipeline, state_cache_size: int = 200_000,
                 max_in_flight_per_host: int = 512) -> None:
        self.store = store
        self.sequencer = sequencer
        self.identity = identity
        self.hosts = hosts
        self.metrics = metrics
        self.config = config
        self.pipeline = pipeline
        #: first reconnect delay (seconds); doubles per failure up to 30 s
        self.backoff_base = 1.0
        self.max_in_flight_per_host = max_in_flight_per_host
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        #: frames waiting for preparation, per account with a running preparer
        self._did_work: dict[str, collections.deque[_Item]] = {}
        self._preparers: dict[str, asyncio.Task[None]] = {}  # (a task must be referenced)
        self._drainers: dict[str, asyncio.Task[None]] = {}
        self.resync: Callable[[str, str | None], Awaitable[None]] | None = None
        self._runs: dict[str, _HostRun] = {}
        self._states: OrderedDict[str, AccountState] = OrderedDict()
        self._state_cache_size = state_cache_size
        self._buffers: dict[str, list[_Item]] = {}
        self._host_counts: dict[str, int] = {}
        self._closed = False

    # -- subscribers ----------------------------------------------------------------------
    def subscriber_config(self, host: HostState) -> SubscriberConfig:
        """Rate limits (backpressure, never drops): none for trusted hosts, nor for loopback hosts
        in insecure (local testing) mode; else the host's own limits or the untrusted defaults."""
        name, _ = split_host_port(host.hostname)
        local = self.config.allow_insecure_hosts and (name in ("localhost", "::1") or name.startswith("127."))
        if self.hosts.is_trusted(host) or local:
            limits: list[tuple[float, float]] = []
        else:
            limits = list(UNTRUSTED_RATE_LIMITS)
            for i, (value, window) in enumerate(((host.rate_limit_per_second, 1.0),
                                                 (host.rate_limit_per_hour, 3600.0),
                                                 (host.rate_limit_per_day, 86400.0))):
                if value:
                    limits[i] = (float(value), window)
        return SubscriberConfig(rate_limits=limits, backoff_base=self.backoff_base, backoff_max=30.0)

    async def start_host(self, host: HostState) -> None:
        """Start following ``host`` from its durable cursor (no-op when already running)."""
        if self._closed or host.status == "banned":
            return
        run = self._runs.get(host.hostname)
        if run is not None and not run.task.done():
            return
        cursor = await self.store.host_cursor(host.hostname)
        url = host_base_url(host.hostname, insecure=self.config.allow_insecure_hosts, websocket=True)
        # A new host is read from the start of its backfill window (cursor 0), so nothing it
        # emitted before it was added is missed; later runs resume from the durable cursor.
        subscriber = HostSubscriber(url, self._make_on_frame(host.hostname), cursor=cursor or 0,
                                    config=self.subscriber_config(host),
                                    on_cursor_reset=self._make_on_reset(host.hostname),
                                    resolve=self.hosts.guard.connect_address)
        task = asyncio.create_task(self._run_host(host.hostname, subscriber), name=f"host:{host.hostname}")
        self._runs[host.hostname] = _HostRun(subscriber, task)
        if host.status not in ("active", "throttled"):
            await self.store.set_host_status(host.hostname, "active")
        log.info("subscribing", extra=fields(host=host.hostname, cursor=cursor))

    async def _run_host(self, hostname: str, subscriber: HostSubscriber) -> None:
        """Run the host's subscriber; after an unexpected error (e.g. the database is briefly
        unreachable) start a new one from the durable cursor, so the failed frame is re-read."""
        delay = 1.0
        while not self._closed:
            try:
                await subscriber.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self._count("host", "subscriber_error")
                log.exception("subscriber failed; restarting from the durable cursor", extra=fields(host=hostname))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)
            run = self._runs.get(hostname)
            if run is None or run.subscriber is not subscriber or self._closed:
                return
            subscriber = HostSubscriber(subscriber.host, self._make_on_frame(hostname), cursor=subscriber.cursor,
                                        config=subscriber.config, on_cursor_reset=self._make_on_reset(hostname),
                                        resolve=subscriber.resolve)
            run.subscriber = subscriber

    async def stop_host(self, hostname: str) -> None:
        run = self._runs.pop(hostname, None)
        if run is None:
            return
        try:  # a polite close; a host that does not answer the close handshake is cut off
            await asyncio.wait_for(run.subscriber.stop(), 1.0)
        except (TimeoutError, Exception):
            pass
        run.task.cancel()
        await asyncio.wait([run.task], timeout=1.0)

    async def start_all(self) -> None:
        """Resume every non-banned host from its persisted cursor."""
        after: str | None = None
        while True:
            page = await self.store.list_hosts(after=after, limit=500)
            for host in page:
                if host.status != "banned":
                    await self.start_host(host)
            if len(page) < 500:
                return
            after = page[-1].hostname

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(self.stop_host(h) for h in list(self._runs)), return_exceptions=True)
        for task in list(self._drainers.values()):
            task.cancel()

    def subscriber(self, hostname: str) -> HostSubscriber | None:
        run = self._runs.get(hostname)
        return run.subscriber if run else None

    async def watch_hosts(self, *, idle_after: float = 1800.0, offline_after: int = 5) -> None:
        """Derive idle/offline/active host statuses from the subscribers (call periodically)."""
        now = time.monotonic()
        for hostname, run in list(self._runs.items()):
            host = await self.store.get_host(hostname)
            if host is None or host.status in ("banned", "throttled"):
                continue
            sub = run.subscriber
            if sub.connected.is_set():
                status = "idle" if run.last_frame and now - run.last_frame > idle_after else "active"
            elif sub.counters.get("connection_failed", 0) >= offline_after and not sub.connected.is_set():
                status = "offline"
            else:
                continue
            if status != host.status:
                await self.store.set_host_status(hostname, status)
                log.info("host status", extra=fields(host=hostname, status=status))

    def _make_on_frame(self, hostname: str) -> Callable[[UpstreamFrame], Awaitable[None]]:
        async def on_frame(uf: UpstreamFrame) -> None:
            run = self._runs.get(hostname)
            if run is not None:
                run.last_frame = time.monotonic()
            await self.handle(hostname, uf)

        return on_frame

    def _make_on_reset(self, hostname: str) -> Callable[[int | None, str], Awaitable[None]]:
        async def on_reset(old: int | None, reason: str) -> None:
            self.metrics.verdicts.labels(kind="host", reason=reason).inc()
            await self.store.set_host_cursor(hostname, 0)

        return on_reset

    # -- account state --------------------------------------------------------------------
    async def account(self, did: str) -> AccountState | None:
        state = self._states.get(did)
        if state is not None:
            self._states.move_to_end(did)
            return state
        state = await self.store.get_account(did)
        if state is not None:
            self._remember(state)
        return state

    def _remember(self, state: AccountState) -> None:
        self._states[state.did] = state
        self._states.move_to_end(state.did)
        while len(self._states) > self._state_cache_size:
            self._states.popitem(last=False)

    def forget(self, did: str) -> None:
        """Drop the in-memory state (after an out-of-band change, e.g. a Spark repair)."""
        self._states.pop(did, None)

    # -- per frame ------------------------------------------------------------------------
    def _count(self, kind: str, reason: str) -> None:
        self.metrics.child(self.metrics.verdicts, kind, reason).inc()

    def _queue_for(self, hostname: str) -> asyncio.Queue[_Item]:
        """The host's reorder queue and its drainer (frames leave in upstream order)."""
        queue = self._queues.get(hostname)
        if queue is None:
            queue = self._queues[hostname] = asyncio.Queue(self.max_in_flight_per_host)
            task = asyncio.create_task(self._drain(hostname, queue), name=f"drain:{hostname}")
            self._drainers[hostname] = task
        return queue

    async def handle(self, hostname: str, uf: UpstreamFrame) -> None:
        """Take one upstream frame; never raises for bad input (it is counted instead).

        Frames leave in upstream order (the host's reorder queue). The work before validation —
        identity resolution, host binding, account admission, ``#identity``/``#account``
        handling — runs in one task per account with frames waiting (an account's frames are
        prepared in order; different accounts proceed concurrently, so a slow DID resolution
        does not hold up the whole host). Validation itself runs in the pipeline.
        """
        kind = uf.frame.t or ""
        self.metrics.child(self.metrics.events_in, hostname, kind).inc()
        item = _Item(hostname, uf, kind, time.monotonic())
        did = _did_of(kind, uf.frame.body)
        if did is None:
            self._count("reject", "bad_did")
        elif kind not in ("#commit", "#sync", "#identity", "#account"):
            self._count("ignore", "unknown_type")
        else:
            item.prep = asyncio.get_running_loop().create_future()
            work = self._did_work.get(did)
            if work is not None:  # the account's preparer is running: it takes this one next
                work.append(item)
            else:
                work = self._did_work[did] = collections.deque((item,))
                self._preparers[did] = asyncio.create_task(self._prepare_account(did, work))
        queue = self._queues.get(hostname)
        await (queue if queue is not None else self._queue_for(hostname)).put(item)

    async def _prepare_account(self, did: str, work: collections.deque[_Item]) -> None:
        """Prepare the account's queued frames in order (one task per burst of an account, not
        per frame), resolving each frame's ``prep`` future as it is done."""
        try:
            while work:
                item = work[0]
                try:
                    await self._prepare_now(item, did)
                finally:
                    work.popleft()
                    if item.prep is not None and not item.prep.done():
                        item.prep.set_result(None)
        finally:
            if self._did_work.get(did) is work:
                del self._did_work[did]
                self._preparers.pop(did, None)
            for left in work:  # only when cancelled (shutdown): never report them as prepared
                if left.prep is not None:
                    left.prep.cancel()

    async def _prepare_now(self, item: _Item, did: str) -> None:
        try:
            if item.kind in ("#commit", "#sync"):
                await self._prepare_repo_event(item, did)
            elif item.kind == "#identity":
                item.event = await self._identity_event(item.hostname, did, item.uf)
            else:
                item.event = await self._account_event(item.hostname, did, item.uf)
        except IdentityError as exc:
            self._count("reject", f"identity_{exc.reason}")
        except Exception:  # never let one frame stop the host; counted and logged
            self._count("reject", "internal_error")
            log.exception("preparing a frame failed", extra=fields(host=item.hostname, did=did))

    async def _prepare_repo_event(self, item: _Item, did: str) -> None:
        hostname = item.hostname
        ident = await self._resolve_for_host(did, hostname)
        if ident is None:
            self._count("reject", "wrong_host")
            return
        stored = await self.account(did)
        if stored is not None and stored.sync_state == "throttled":
            self._count("ignore", "account_throttled")
            return
        state = await self._admit_account(hostname, did, stored)
        if state is None:
            self._count("ignore", "account_throttled")
            return
        item.did = did
        item.state = state
        item.signing_key = ident.signing_key
        item.verdict = await self.pipeline.submit(did, item.uf.raw, None if stored is None else state,
                                                  ident.signing_key)

    async def _drain(self, hostname: str, queue: asyncio.Queue[_Item]) -> None:
        while True:
            item = await queue.get()
            try:
                if item.prep is not None:
                    await item.prep
                event = item.event
                if item.verdict is not None:
                    verdict = await item.verdict
                    event = await self._apply(item, verdict)
                if event is None:
                    await self._skip(hostname, item.uf.seq)
                else:
                    await self._submit(hostname, item.uf.seq, event, item.received)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("ingest drain failed", extra=fields(host=hostname))

    async def _skip(self, hostname: str, upstream_seq: int) -> None:
        """A frame that produced no event: persist the cursor now and then (not every time)."""
        sub = self.subscriber(hostname)
        acked = sub.cursor if sub is not None else None
        if acked is None or upstream_seq - acked >= 100:
            await self.sequencer.advance_cursor(hostname, upstream_seq)
            if sub is not None:
                sub.ack(upstream_seq)

    async def _submit(self, hostname: str, upstream_seq: int, event: PendingEvent, received: float) -> None:
        event.host = hostname
        event.upstream_seq = upstream_seq
        future = await self.sequencer.enqueue(event)
        future.add_done_callback(functools.partial(self._durable, hostname, upstream_seq, event, received))

    def _durable(self, hostname: str, upstream_seq: int, event: PendingEvent, received: float,
                 future: asyncio.Future[Any]) -> None:
        """Done-callback of a sequencer future: ack the upstream cursor once the event is durable."""
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            # Nothing of the batch was stored: drop our optimistic state so it is reloaded, and
            # do not ack (the frame is re-delivered after a reconnect/restart).
            self.forget(event.did)
            log.warning("sequencing failed", extra=fields(host=hostname, did=event.did, error=str(exc)))
            return
        sub = self.subscriber(hostname)
        if sub is not None:
            sub.ack(upstream_seq)
        result = future.result()
        if result is None:
            self._count("ignore", "already_sequenced")
            return
        self.metrics.child(self.metrics.events_out, event.kind).inc()
        self.metrics.current_seq.set(result.seq)
        self.metrics.lag.observe(time.monotonic() - received)

    async def _resolve_for_host(self, did: str, hostname: str) -> Identity | None:
        """The identity if ``hostname`` is the account's PDS (after one fresh re-resolution)."""
        ident = await self.identity.resolve(did)
        if ident.pds_hostname == hostname:
            return ident
        ident = await self.identity.resolve(did, fresh=True)
        return ident if ident.pds_hostname == hostname else None

    async def _admit_account(self, hostname: str, did: str, state: AccountState | None) -> AccountState | None:
        """State for an account seen on ``hostname``; None when it is held as throttled."""
        if state is not None and state.host == hostname:
            return state
        if state is not None:  # migrated here (the DID document says so): rebind
            state = dataclasses.replace(state, host=hostname)
            self._remember(state)
            return state
        host = await self.store.get_host(hostname)
        limit = self.hosts.account_limit(host) if host is not None else self.config.default_account_limit
        if hostname not in self._host_counts:
            loaded = await self.store.count_accounts(hostname)
            self._host_counts.setdefault(hostname, loaded)
        # check and count with no await in between: accounts are admitted concurrently
        count = self._host_counts[hostname]
        self._host_counts[hostname] = count + 1
        if limit is not None and count >= limit:
            held = AccountState(did=did, host=hostname, sync_state="throttled", updated_at=time.time())
            await self.store.upsert_account(held)
            self._remember(held)
            if host is not None and host.status == "active":
                await self.store.set_host_status(hostname, "throttled")
            return None
        return AccountState(did=did, host=hostname)

    async def _apply(self, item: _Item, verdict: Any) -> PendingEvent | None:
        """Turn a verdict into an event (or a count, a buffer entry, a desync mark)."""
        did = item.did
        assert did is not None and item.state is not None
        current = self._states.get(did) or item.state
        if verdict.kind == "desync" and (verdict.reason == "resync_in_progress"
                                         or current.sync_state in ("desynchronized", "resyncing")):
            # an earlier frame of this account (already drained) desynchronized it: this one was
            # judged against the state before that mark, so it waits for the resync as well
            if current.sync_state in ("desynchronized", "resyncing"):
                buf = self._buffers.setdefault(did, [])
                if len(buf) < MAX_BUFFER_PER_ACCOUNT:
                    buf.append(item)
                    self._count("buffer", "resync_pending")
                else:
                    self._count("ignore", "resync_buffer_full")
                return None
            # the resync finished while this frame was in flight: judge it again, in order
            self.pipeline.forget(did)
            verdict = await self.pipeline.validate(did, item.uf.raw, current, item.signing_key)
        self._count(verdict.kind, verdict.reason)
        if verdict.kind != "accept":
            log.debug("verdict", extra=fields(did=did, kind=verdict.kind, reason=verdict.reason,
                                             rev=item.uf.frame.body.get("rev"), since=item.uf.frame.body.get("since"),
                                             stored_rev=current.rev, host=item.hostname))
        if verdict.kind == "accept" and verdict.new_state is not None:
            # The verdict's state is a fresh object (unpickled, or built by the validator); the
            # pipeline caches it but reads only rev/commit_cid/data_cid/sync_state from it, so it
            # is completed in place rather than copied.
            new_state = verdict.new_state
            new_state.host = item.hostname
            new_state.upstream_status = current.upstream_status
            new_state.local_status = current.local_status
            new_state.updated_at = time.time()
            if item.kind == "#sync":
                self._buffers.pop(did, None)
                new_state.sync_state = "synced"
            self._remember(new_state)
            if verdict.body_cbor is not None:  # encoded by the validation worker: seq is spliced in
                return PendingEvent(item.kind, did, _NO_BODY, new_state.rev, new_state,
                                    body_cbor=verdict.body_cbor, seq_offset=verdict.seq_offset)
            body = outgoing_body(item.kind, item.uf.frame.body)
            return PendingEvent(kind=item.kind, did=did, body=body, rev=new_state.rev, account=new_state)
        if verdict.kind == "desync":
            await self.mark_desynchronized(current, item.hostname)
        return None

    async def mark_desynchronized(self, state: AccountState, hostname: str | None) -> None:
        marked = dataclasses.replace(state, sync_state="desynchronized", updated_at=time.time())
        self._remember(marked)
        await self.store.upsert_account(marked)
        if self.resync is not None:
            await self.resync(marked.did, hostname)

    async def _identity_event(self, hostname: str, did: str, uf: UpstreamFrame) -> PendingEvent | None:
        await self.identity.purge(did)
        ident = await self.identity.resolve(did, fresh=True)
        if ident.pds_hostname != hostname:
            self._count("reject", "wrong_host")
            return None
        stored = await self.account(did)
        if stored is not None and stored.sync_state == "throttled":
            self._count("ignore", "account_throttled")
            return None
        state = await self._admit_account(hostname, did, stored)
        if state is None:
            self._count("ignore", "account_throttled")
            return None
        if stored is None:
            self._remember(state)
        if not state.active:
            self._count("ignore", "account_inactive")
            return None
        body = {k: v for k, v in uf.frame.body.items() if k not in ("seq", "handle")}
        handle = uf.frame.body.get("handle")
        if isinstance(handle, str) and handle:
            if await self.identity.verify_handle(handle.lower(), did):
                body["handle"] = handle
            else:
                self._count("strip", "handle_not_verified")
        self._count("accept", "ok")
        return PendingEvent(kind="#identity", did=did, body=body)

    async def _account_event(self, hostname: str, did: str, uf: UpstreamFrame) -> PendingEvent | None:
        body = uf.frame.body
        active = body.get("active")
        status = body.get("status")
        if not isinstance(active, bool) or (status is not None and not isinstance(status, str)):
            self._count("reject", "bad_field_type")
            return None
        # Status changes are rare and decisive: check the binding against a fresh DID document
        # (a cached one would let a host the account just left deactivate it).
        ident = await self.identity.resolve(did, fresh=True, max_age=5.0)
        if ident.pds_hostname != hostname:
            self._count("reject", "wrong_host")
            return None
        stored = await self.account(did)
        held_already = stored is not None and stored.sync_state == "throttled"
        state = None if held_already else await self._admit_account(hostname, did, stored)
        if state is None:  # held: keep the status, emit nothing
            held = await self.account(did)
            if held is not None:
                upstream = "active" if active else (status or "deactivated")
                held = dataclasses.replace(held, upstream_status=upstream)
                self._remember(held)
                await self.store.upsert_account(held)
            self._count("ignore", "account_throttled")
            return None
        upstream = "active" if active else (status or "deactivated")
        new_state = dataclasses.replace(state, upstream_status=upstream, updated_at=time.time())
        self._remember(new_state)
        out = account_event_body(new_state)
        if isinstance(body.get("time"), str):
            out["time"] = body["time"]
        self._count("accept", "ok")
        return PendingEvent(kind="#account", did=did, body=out, account=new_state)

    # -- resync hand-back -----------------------------------------------------------------
    async def finish_resync(self, did: str, new_state: AccountState, sync_body: dict[str, Any]) -> None:
        """Emit the ``#sync`` of a completed resync, then judge the commits buffered meanwhile."""
        current = await self.account(did)
        if current is not None:
            new_state = dataclasses.replace(new_state, upstream_status=current.upstream_status,
                                            local_status=current.local_status)
        state = dataclasses.replace(new_state, sync_state="synced")
        self._remember(dataclasses.replace(state, sync_state="resyncing"))
        self.pipeline.forget(did)
        if state.active:
            event = PendingEvent(kind="#sync", did=did, body=sync_body, account=state)
            await (await self.sequencer.enqueue(event))
        else:
            await self.store.upsert_account(state)
        while True:
            buffered = self._buffers.get(did)
            if not buffered:
                break
            item = buffered.pop(0)
            self._remember(dataclasses.replace(state, sync_state="resyncing"))
            if str(item.uf.frame.body.get("rev", "")) <= (state.rev or ""):
                self._count("ignore", "covered_by_resync")
                continue
            self.pipeline.forget(did)
            verdict = await self.pipeline.validate(did, item.uf.raw, state, item.signing_key)
            self._remember(state)
            event = await self._apply(item, verdict)
            if verdict.kind == "desync":
                return  # marked again; a new resync is queued
            if event is not None and event.account is not None:
                state = event.account
                await self._submit(item.hostname, item.uf.seq, event, item.received)
        self._buffers.pop(did, None)
        self.pipeline.forget(did)
        self._remember(state)

    async def set_local_status(self, did: str, local_status: str) -> AccountState:
        """Operator takedown / reversal: store it and emit ``#account`` with the combined status."""
        state = await self.account(did)
        if state is None:
            state = AccountState(did=did)
        new_state = dataclasses.replace(state, local_status=local_status, updated_at=time.time())
        self._remember(new_state)
        await self.store.upsert_account(new_state)  # event upserts never touch local_status
        await (await self.sequencer.enqueue(PendingEvent(kind="#account", did=did,
                                                          body=account_event_body(new_state),
                                                          account=new_state)))
        return new_state
