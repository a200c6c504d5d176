"""One lane per account: the single owner of an account's state between "frame received" and
"durably sequenced".

A lane holds, for one DID:

* ``durable`` — the account state as stored (loaded from the store, or confirmed by the
  sequencer for an event this lane submitted);
* ``head`` (derived) — ``durable`` plus every accepted event still in flight: what the next frame is
  judged against, so consecutive commits chain before the previous one is durable;
* ``inflight`` — those accepted events, in order, each with the head it produced;
* ``jobs`` — what waits to be judged, strictly in arrival order: upstream frames (``Work``) and
  operations that change the account from inside the relay (takedown, resync completion, Spark
  repairs), so both kinds are ordered with each other;
* ``buffer`` — frames held while the account is being resynchronised.

Frames of one account are judged one at a time; different accounts are judged concurrently (the
verdicts come from ``firehose.pipeline.ValidationPool``'s worker processes). The host run
(``relay.ingest.hostruns``) hands the accepted events to the sequencer in upstream order and reports each
outcome back through ``settled``:

* stored → ``durable`` becomes that event's state;
* not stored → the event's ``Fence`` was revoked by the sequencer, so every other in-flight event
  of the same upstream run is doomed too: they are dropped from ``inflight`` and ``head`` rolls back
  to the last surviving one (or ``durable``). The run re-reads them all from its durable cursor, and
  the next commit is judged against what the store really holds — never chained on an unsaved one;
* "already sequenced" (the store held a newer state at write time: an out-of-band writer) → the
  lane reloads from the store once nothing is in flight.

An account carried by two relay upstreams has two host runs handing its events over, each in
its own order: a frame from one run is judged only once no event accepted from another run is
still in flight, so an event never reaches the sequencer ahead of the one it is chained on.

Operations wait until nothing is in flight (``_quiet``) and build on ``durable``, so a takedown
or a resync never carries a state that a failed write could still take back. Idle lanes keep only
their durable state, in one bounded LRU (reloaded from the store on a miss).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from backfill.outbox import Repair, RepairOutcome, decide_repair, repaired_state
from backfill.sequencer import Sequencer
from backfill.store import Store
from firehose.backoff import backoff_delay
from firehose.lru import BoundedLRU
from firehose.messages import AccountMessage, IdentityMessage, MessageError, parse_message
from firehose.pipeline import ValidationPool
from firehose.reasons import Reason
from firehose.state import AccountState, Fence, PendingEvent, SequencedEvent
from firehose.subscriber import UpstreamFrame
from firehose.validate import Verdict, identity_body, outgoing_body, validate_account, validate_identity
from mst import cbor
from mst.syntax import is_valid_tid
from mst.tid import tid_to_micros
from relay.accounts import account_event_body, now_iso
from relay.batched import BatchedLookup
from relay.identity import UNREACHABLE, IdentityError, IdentityResolver
from relay.ingest.admission import Admission
from relay.ingest.resync_queue import ResyncQueue
from relay.jsonlog import fields

log = logging.getLogger("relay.ingest.lanes")

#: Seconds of clock skew allowed between a host's TIDs and the relay (``_missed_history``).
UNSEEN_HISTORY_MARGIN = 300.0


def retry_pauses(total: float, first: float = 1.0, cap: float = 30.0) -> tuple[float, ...]:
    """The pauses of ``backoff_delay(attempt, first, cap)`` whose sum stays within ``total`` s."""
    pauses: list[float] = []
    while sum(pauses) + (pause := backoff_delay(len(pauses), first, cap)) <= total:
        pauses.append(pause)
    return tuple(pauses)


#: Seconds between the tries of a frame whose account's identity could not be resolved for a
#: transient reason (directory or PDS unreachable, timed out, rate limited): 1 minute in all.
IDENTITY_RETRY: tuple[float, ...] = retry_pauses(60.0)
#: What a held frame costs beyond its bytes (its ``Work``), in the resync queue's held-bytes ledger.
HELD_FRAME_OVERHEAD = 512
#: ``PendingEvent.body`` of a pre-encoded event (the sequencer does not read it); never mutated.
_NO_BODY: dict[str, Any] = {}

Count = Callable[[str, str], None]
#: The host whose frame the current task is judging (a lane's task while in ``_frame``, a host
#: run's task throughout): ``count`` callbacks read it to count verdicts per host as well.
FRAME_HOST: contextvars.ContextVar[str | None] = contextvars.ContextVar("frame_host", default=None)
M = TypeVar("M", IdentityMessage, AccountMessage)


@dataclasses.dataclass(slots=True, eq=False)
class Work:
    """One upstream frame on its way: received by a host run, judged in its account's lane
    (``judged`` resolves to the event to sequence, or None), sequenced by the host run."""

    hostname: str
    uf: UpstreamFrame
    kind: str
    did: str
    received: float
    fence: Fence
    judged: asyncio.Future[PendingEvent | None]
    signing_key: str | None = None
    #: the host's settings at dispatch: judge sync 1.0 commits leniently; the host is a relay
    lenient: bool = False
    relay: bool = False
    #: when the relay began following the host (``HostState.created_at``; 0: unknown)
    followed_since: float = 0.0


_Op = Callable[["_Lane"], Awaitable[Any]]


def _not_speaker(work: Work) -> Reason:
    """Why a host may not speak for the account (``relay.ingest.admission``)."""
    return Reason.RELAY_NOT_AUTHORITATIVE if work.relay else Reason.WRONG_HOST


def _digest(work: Work) -> bytes:
    """The identity of a relayed event: its body without the upstream's ``seq``."""
    body = {k: v for k, v in work.uf.frame.body.items() if k != "seq"}
    try:
        data = cbor.encode(body)
    except (TypeError, ValueError):  # not encodable canonically: never equal to another copy
        data = work.uf.raw
    return hashlib.sha256(work.kind.encode() + data).digest()


@dataclasses.dataclass(slots=True, eq=False)
class _OpJob:
    run: _Op
    done: asyncio.Future[Any]


@dataclasses.dataclass(slots=True, eq=False)
class _Lane:
    did: str
    durable: AccountState | None = None
    loaded: bool = False
    stale: bool = False
    task: asyncio.Task[None] | None = None  # the lane's task while it has jobs (held: never collected)
    jobs: deque[Work | _OpJob] = dataclasses.field(default_factory=deque)
    inflight: list[tuple[PendingEvent, AccountState | None]] = dataclasses.field(default_factory=list)
    buffer: list[Work] = dataclasses.field(default_factory=list)
    quiet: list[asyncio.Future[None]] = dataclasses.field(default_factory=list)
    #: the host whose run submits the frame events in ``inflight`` (meaningful while it is not empty)
    inflight_host: str | None = None
    #: False after a frame's identity lookups failed through every retry: the next frames are
    #: tried once each (no minute of retries per queued frame) until a lookup succeeds
    identity_ok: bool = True

    @property
    def head(self) -> AccountState | None:
        """``durable`` plus every accepted event still in flight (what the next frame is judged
        against). Derived, so dropping failed events from ``inflight`` is the whole rollback."""
        return self.inflight[-1][1] if self.inflight else self.durable


class AccountLanes:
    """All lanes (see the module docstring). ``count(kind, reason)`` counts verdicts (metrics)."""

    def __init__(self, *, store: Store, sequencer: Sequencer, pool: ValidationPool, admission: Admission,
                 identity: IdentityResolver, resync: ResyncQueue, count: Count,
                 idle_cache: int = 200_000, relay_dedup: int = 100_000,
                 clock: Callable[[], float] = time.time, handle_wait: float = 1.0,
                 history_margin: float = UNSEEN_HISTORY_MARGIN,
                 identity_retry: tuple[float, ...] = IDENTITY_RETRY) -> None:
        """``handle_wait``: how long an ``#identity`` waits for its handle's check before it is
        passed on with the handle stripped (the handle follows in a later ``#identity`` if the
        check succeeds: ``_verify_later``). ``history_margin``: the clock skew allowed to hosts
        by ``_missed_history``. ``identity_retry``: the pauses (each jittered ±20 %) between tries
        of a frame whose identity lookup failed for a transient reason (``_frame``)."""
        self.store = store
        self.sequencer = sequencer
        self.pool = pool
        self.admission = admission
        self.identity = identity
        self.resync = resync
        self.count = count
        self.clock = clock
        self.identity_refreshes = 0
        self.handle_wait = handle_wait
        self.history_margin = history_margin
        self.identity_retry = identity_retry
        #: did → token of the handle follow-up still due (``_verify_later``)
        self._later_handles: dict[str, object] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._lanes: dict[str, _Lane] = {}
        self._idle: BoundedLRU[str, AccountState | None] = BoundedLRU(idle_cache)
        #: (did, kind) -> digest of the last #identity/#account accepted from a relay upstream:
        #: the same event carried by a second relay is dropped (commits dedup by rev instead)
        self._relayed: BoundedLRU[tuple[str, str], bytes] = BoundedLRU(relay_dedup)
        #: lanes loading at once share one query (a burst of never-seen accounts)
        self._accounts: BatchedLookup[str, AccountState] = BatchedLookup(store.get_accounts)

    async def close(self) -> None:
        """Cancel the background work (handle follow-ups still waiting for their check)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    # -- lanes ---------------------------------------------------------------------------------
    def _lane(self, did: str) -> _Lane:
        lane = self._lanes.get(did)
        if lane is None:
            lane = self._lanes[did] = _Lane(did)
            if did in self._idle:
                lane.durable = self._idle.pop(did)
                lane.loaded = True
        return lane

    def _start(self, lane: _Lane) -> None:
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(self._run(lane), name=f"lane:{lane.did}")

    def _maybe_idle(self, lane: _Lane) -> None:
        """A lane with nothing queued, in flight, buffered or awaited keeps only its durable state."""
        if lane.task is not None or lane.jobs or lane.inflight or lane.buffer or lane.quiet:
            return
        if self._lanes.get(lane.did) is lane:
            del self._lanes[lane.did]
        if lane.loaded and not lane.stale:
            self._idle.put(lane.did, lane.durable)

    def state(self, did: str) -> AccountState | None:
        """The account's head as the relay holds it now (None when not in memory)."""
        lane = self._lanes.get(did)
        if lane is not None:
            return lane.head
        return self._idle.peek(did)

    # -- entry points --------------------------------------------------------------------------
    def submit(self, work: Work) -> None:
        """Queue an upstream frame in its account's lane (judged after everything queued before)."""
        lane = self._lane(work.did)
        lane.jobs.append(work)
        self._start(lane)

    async def run_op(self, did: str, op: _Op) -> Any:
        """Run ``op(lane)`` in the account's lane, after everything queued before it."""
        lane = self._lane(did)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        lane.jobs.append(_OpJob(op, done))
        self._start(lane)
        return await done

    def settled(self, event: PendingEvent, fut: asyncio.Future[SequencedEvent | None]) -> None:
        """Done-callback of the sequencer future of an event this lane accepted (see module doc)."""
        failed = fut.cancelled() or fut.exception() is not None
        if failed and event.fence is not None and fut.cancelled():
            event.fence.revoke("cancelled")
        self._settle(event, None if failed else fut.result(), failed)

    def dropped(self, event: PendingEvent) -> None:
        """An accepted event its host run did not submit (its fence was revoked first)."""
        self._settle(event, None, True)

    def _set_durable(self, lane: _Lane, state: AccountState) -> None:
        """``state`` is stored: the lane's durable state, and the hosts' account counts follow."""
        before = lane.durable
        if before is None:
            if state.host is not None:
                self.admission.stored(state.host, lane.did)
        elif before.host != state.host:
            self.admission.moved(before.host, state.host)
        lane.durable = state

    def _settle(self, event: PendingEvent, result: SequencedEvent | None, failed: bool) -> None:
        if failed:  # a relayed copy not stored is re-read: let it (or another relay's copy) through
            self._relayed.pop((event.did, event.kind))
        lane = self._lanes.get(event.did)
        if lane is None:
            return
        for i, (pending, _) in enumerate(lane.inflight):
            if pending is event:
                del lane.inflight[i]
                break
        if failed:
            if lane.durable is None and event.host is not None:
                self.admission.released(event.host, event.did)
            for doomed, _ in lane.inflight:
                if doomed.fence is not None and not doomed.fence.valid:
                    self._relayed.pop((doomed.did, doomed.kind))
            lane.inflight = [e for e in lane.inflight if e[0].fence is None or e[0].fence.valid]
        elif result is None:
            self.count("ignore", Reason.ALREADY_SEQUENCED)
            if lane.durable is None and event.host is not None:
                self.admission.released(event.host, event.did)
            lane.stale = True
        elif event.account is not None:
            self._set_durable(lane, event.account)
        if not lane.inflight:
            for waiter in lane.quiet:
                if not waiter.done():
                    waiter.set_result(None)
            lane.quiet.clear()
            self._maybe_idle(lane)

    # -- the lane's task -----------------------------------------------------------------------
    async def _run(self, lane: _Lane) -> None:
        try:
            while lane.jobs:
                job = lane.jobs[0]
                try:
                    if isinstance(job, Work):
                        await self._frame(lane, job)
                    else:
                        await self._op(lane, job)
                finally:
                    lane.jobs.popleft()
        finally:
            lane.task = None
            for job in lane.jobs:  # only when cancelled (shutdown)
                (job.judged if isinstance(job, Work) else job.done).cancel()
            self._maybe_idle(lane)

    async def _load(self, lane: _Lane) -> None:
        if not lane.loaded or (lane.stale and not lane.inflight):
            lane.durable = await self._accounts.get(lane.did)
            lane.loaded = True
            lane.stale = False

    async def _quiet(self, lane: _Lane) -> None:
        """Wait until none of the lane's accepted events is in flight (each stored or dropped)."""
        while lane.inflight:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            lane.quiet.append(waiter)
            await waiter

    async def _op(self, lane: _Lane, job: _OpJob) -> None:
        try:
            await self._quiet(lane)
            await self._load(lane)
            result = await job.run(lane)
        except BaseException as exc:
            if not job.done.done():
                job.done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            if not job.done.done():
                job.done.set_result(result)

    def _advance(self, lane: _Lane, event: PendingEvent, head: AccountState | None) -> None:
        lane.inflight.append((event, head))

    async def submit_own(self, lane: _Lane, event: PendingEvent) -> SequencedEvent | None:
        """Sequence an event of an operation (not of an upstream frame) and wait until it is
        durable; the lane's head and durable state follow it."""
        self._advance(lane, event, event.account if event.account is not None else lane.head)
        fut = await self.sequencer.enqueue(event)
        fut.add_done_callback(lambda f: self.settled(event, f))
        return await fut

    # -- judging an upstream frame -------------------------------------------------------------
    async def _frame(self, lane: _Lane, work: Work) -> None:
        event: PendingEvent | None = None
        host_token = FRAME_HOST.set(work.hostname)
        try:
            if lane.inflight and lane.inflight_host != work.hostname:
                # Each host run hands its accepted events to the sequencer itself, in its own order.
                # An event chained on another run's unsubmitted one could reach the sequencer first,
                # and the earlier one would then be dropped as already sequenced: a hole (two relays
                # carrying one account). Judge it once the other run's events are settled instead.
                # No cycle of such waits: each waits only for events that arrived before it.
                await self._quiet(lane)
            event = await self._judge_frame(lane, work)
        except IdentityError as exc:
            self.count("reject", f"identity_{exc.reason}")
            log.warning("identity unavailable; frame rejected", extra=fields(
                host=work.hostname, did=work.did, kind=work.kind, reason=exc.reason, error=str(exc)[:200]))
            head = lane.head
            if (exc.reason in UNREACHABLE and work.kind in ("#commit", "#sync") and head is not None
                    and head.sync_state != "desynchronized"):
                # A known account's commit that could not be checked is not dropped for good:
                # the account is resynchronised (retried until it succeeds) and its #sync covers it.
                await self._quiet(lane)
                await self._mark_desynchronized(lane, work.hostname)
        except Exception as exc:  # never let one frame stop the host; counted and logged
            if self.store.is_transient(exc):  # the store is down: have the run re-read this frame
                work.fence.revoke("store_unavailable")
            self.count("reject", Reason.INTERNAL_ERROR)
            log.exception("judging a frame failed", extra=fields(host=work.hostname, did=work.did))
        finally:
            FRAME_HOST.reset(host_token)
            if event is not None:
                lane.inflight_host = work.hostname
            elif lane.durable is None and not lane.inflight:  # nothing of the account is stored
                self.admission.released(work.hostname, work.did)
            if not work.judged.done():
                work.judged.set_result(event)

    async def _judge_frame(self, lane: _Lane, work: Work) -> PendingEvent | None:
        """Judge ``work``; a transient identity failure (the DID directory or the account's PDS
        unreachable, timed out, rate limited) is tried again after each pause of
        ``identity_retry``, holding only this account's lane (other accounts, of this host too,
        go on; the host's watermark waits). Raises the last ``IdentityError`` when every try
        failed, at once for a permanent one (unknown DID, bad document)."""
        pauses = iter(self.identity_retry if lane.identity_ok else ())
        while True:
            if not work.fence.valid:  # its run is being restarted and re-reads it
                return None
            if not lane.loaded or lane.stale:  # (``_load``'s test, without a coroutine when loaded)
                await self._load(lane)
            try:
                if work.kind in ("#commit", "#sync"):
                    event = await self._repo_event(lane, work)
                elif work.kind == "#identity":
                    event = await self._identity_event(lane, work)
                else:
                    event = await self._account_event(lane, work)
            except IdentityError as exc:
                pause = next(pauses, None) if exc.reason in UNREACHABLE else None
                if pause is None:
                    # the lane's next frames get one try each until a lookup succeeds again
                    lane.identity_ok = exc.reason not in UNREACHABLE
                    raise
                self.count("retry", f"identity_{exc.reason}")
                await asyncio.sleep(pause * random.uniform(0.8, 1.2))
                continue
            lane.identity_ok = True
            return event

    async def _judge(self, work: Work, state: AccountState | None, key: str) -> Verdict:
        did, raw, lenient = work.did, work.uf.raw, work.lenient
        verdict = await self.pool.judge(raw, state, key, lenient=lenient)
        if verdict.reason == Reason.BAD_SIGNATURE:  # I-D §4.5: maybe a key rotation; refresh once
            self.identity_refreshes += 1
            try:
                fresh: str | None = (await self.identity.resolve(did, fresh=True)).signing_key
            except IdentityError as exc:
                if exc.reason in UNREACHABLE:  # maybe a rotation we cannot see yet: try it later
                    raise
                fresh = None
            if fresh is not None and fresh != key:
                verdict = await self.pool.judge(raw, state, fresh, lenient=lenient)
        return verdict

    async def _admitted(self, lane: _Lane, work: Work) -> AccountState | None:
        """The state to judge against, or None (counted) when the account is held (an account
        first seen over its host's limit is stored held here)."""
        head = lane.head
        state = None
        if head is not None and head.host == work.hostname and head.sync_state != "throttled":
            return head  # (what ``Admission.admit`` answers for an account bound here, without a coroutine)
        if head is None or head.sync_state != "throttled":
            state = await self.admission.admit(work.hostname, work.did, head)
        if state is not None and state.sync_state == "throttled":  # just held
            await self._quiet(lane)
            await self.sequencer.write_account(state)
            self._set_durable(lane, state)
            state = None
        if state is None:
            self.count("ignore", Reason.ACCOUNT_THROTTLED)
        return state

    async def _repo_event(self, lane: _Lane, work: Work) -> PendingEvent | None:
        did = work.did
        ident = None if work.relay else self.admission.identity_cached(did, work.hostname)
        if ident is None:
            ident = await self.admission.identity_for_host(did, work.hostname, relay=work.relay)
        if ident is None:
            self.count("reject", _not_speaker(work))
            return None
        known = lane.head is not None
        verdict: Verdict | None = None
        if not known:  # verified before it may take a place on its host: a forgery takes none
            verdict = await self._judge(work, None, ident.signing_key)
            if verdict.kind != "accept":
                self.count(verdict.kind, verdict.reason)
                return None
        state = await self._admitted(lane, work)
        if state is None:
            return None
        work.signing_key = ident.signing_key
        if state.sync_state in ("desynchronized", "resyncing"):
            return await self._hold(lane, work, state, ident.signing_key)
        if verdict is None:
            verdict = await self._judge(work, state, ident.signing_key)
        elif self._missed_history(work, self.history_margin):
            # e.g. a host wiped and past its old cursor before the relay reconnected: the commits
            # before this one were never read. Resync the account (one #sync covers them).
            self.count("desync", Reason.UNSEEN_HISTORY)
            await self._mark_desynchronized(lane, work.hostname, state)
            assert lane.durable is not None
            return await self._hold(lane, work, lane.durable, ident.signing_key)
        event = await self._apply(lane, work, state, verdict)
        if event is None and verdict.kind == "desync" and work.lenient and lane.head is not None \
                and lane.head.sync_state == "desynchronized":  # lenient: passes as it verifies (``_hold``)
            return await self._hold(lane, work, lane.head, ident.signing_key)
        if event is not None:
            self._advance(lane, event, event.account)
        return event

    @staticmethod
    def _missed_history(work: Work, margin: float) -> bool:
        """Does this first-seen account's ``#commit`` chain on a commit made while the relay was
        already following the host (``since`` is a TID: its time is when that commit was made)?
        Then the relay should have read that commit and did not. A commit chained on history from
        before the relay followed the host (the common case of a host just added) is not."""
        since = work.uf.frame.body.get("since")
        if work.kind != "#commit" or not work.followed_since or not isinstance(since, str) or not is_valid_tid(since):
            return False
        return tid_to_micros(since) / 1e6 > work.followed_since + margin

    async def _hold(self, lane: _Lane, work: Work, state: AccountState, key: str) -> PendingEvent | None:
        """A ``#commit``/``#sync`` of an account being resynchronised (``state``); its resync is kicked
        (the host is speaking for it), unless the frame is an accepted ``#sync``. Strict: held in the lane, judged after the resync's ``#sync``;
        the oldest held frames are dropped (``resync_buffer_full``, covered by the ``#sync``) to stay
        under the resync queue's held-bytes bounds. Lenient (as Bluesky's Go relay): judged now
        against the account's key, chained to ``state`` when it chains, else on its own (operation
        inversion against its own ``prevData`` where it has one); an accepted ``#commit`` passes
        (also counted ``pass``/``resync_in_progress``) and the account stays desynchronized, an
        accepted ``#sync`` resets it as always and takes it out of the resync queue."""
        did = lane.did
        if work.lenient:
            base = dataclasses.replace(state, sync_state="synced")
            verdict = await self._judge(work, base, key)
            if verdict.kind == "desync":  # the chain broke (again): the commit judged on its own
                verdict = await self._judge(work, dataclasses.replace(base, rev=None, commit_cid=None,
                                                                      data_cid=None), key)
            event = await self._apply(lane, work, state, verdict)
            if event is None or event.account is None:
                self.resync.kick(did)
                return None
            if work.kind == "#sync":  # accepted: the account is reset (``_apply`` dropped what was held)
                self.resync.release_held(did)
                self.resync.discard(did)
            else:  # passes; the account stays desynchronized
                event.account.sync_state = state.sync_state
                self.count("pass", Reason.RESYNC_IN_PROGRESS)
                self.resync.kick(did)
            self._advance(lane, event, event.account)
            return event
        self.resync.kick(did)
        if not lane.buffer:
            self.resync.release_held(did)
        size = len(work.uf.raw) + HELD_FRAME_OVERHEAD
        while not self.resync.fits(did, size):
            self.count("ignore", Reason.RESYNC_BUFFER_FULL)
            if not lane.buffer or size > self.resync.held_per_account:  # drop this one (alone)
                return None
            oldest = lane.buffer.pop(0)
            self.resync.release_held(did, len(oldest.uf.raw) + HELD_FRAME_OVERHEAD)
        lane.buffer.append(work)
        self.resync.add_held(did, size)
        self.count("buffer", Reason.RESYNC_PENDING)
        return None

    async def _apply(self, lane: _Lane, work: Work, state: AccountState, verdict: Verdict) -> PendingEvent | None:
        """The event an accepted verdict becomes (its ``account`` is the new head; the caller puts
        it in flight), or None after counting, holding or marking the account desynchronized."""
        self.count(verdict.kind, verdict.reason)
        if verdict.kind == "accept" and verdict.new_state is not None:
            # The verdict's state is a fresh object (unpickled from a worker, or built by the
            # validator) that nothing else holds: completed in place rather than copied.
            new_state = verdict.new_state
            new_state.host = state.host or work.hostname  # the binding (relay.ingest.admission)
            new_state.upstream_status = state.upstream_status
            new_state.local_status = state.local_status
            new_state.updated_at = self.clock()
            if work.kind == "#sync":
                lane.buffer.clear()
                new_state.sync_state = "synced"
            if verdict.blocks is not None:  # the slice carried blocks nothing references: dropped
                self.count("strip", Reason.UNREFERENCED_BLOCKS)
            if verdict.body_cbor is not None:  # encoded by the validation worker: seq is spliced in
                event = PendingEvent(work.kind, work.did, _NO_BODY, new_state.rev, new_state,
                                     body_cbor=verdict.body_cbor, seq_offset=verdict.seq_offset,
                                     op_changes=verdict.op_changes)
            else:
                body = work.uf.frame.body
                if verdict.blocks is not None:
                    body = {**body, "blocks": verdict.blocks}
                event = PendingEvent(work.kind, work.did, outgoing_body(work.kind, body), new_state.rev, new_state)
            return event
        if verdict.kind != "accept":
            log.debug("verdict", extra=fields(did=work.did, kind=verdict.kind, reason=verdict.reason,
                                             rev=work.uf.frame.body.get("rev"), host=work.hostname,
                                             stored_rev=state.rev))
        if verdict.kind == "desync":
            await self._quiet(lane)  # build the mark on what is stored, not on what may fail
            if work.fence.valid:
                await self._mark_desynchronized(lane, work.hostname)
        return None

    async def _mark_desynchronized(self, lane: _Lane, hostname: str | None,
                                   base: AccountState | None = None) -> None:
        """Store the account marked desynchronized and queue its resync. ``base``: the state to mark
        (default: the durable one, else a new account on ``hostname``)."""
        base = base or lane.durable or AccountState(did=lane.did, host=hostname)
        marked = dataclasses.replace(base, sync_state="desynchronized", updated_at=self.clock())
        await self.sequencer.write_account(marked)
        self._set_durable(lane, marked)
        await self.resync.enqueue(lane.did)

    def _relayed_again(self, work: Work) -> bool:
        """True (counted ``duplicate_event``) for an ``#identity``/``#account`` from a relay upstream
        that is the very event already accepted from a relay (two relays carry the same stream)."""
        if not work.relay or self._relayed.get((work.did, work.kind)) != _digest(work):
            return False
        self.count("ignore", Reason.DUPLICATE_EVENT)
        return True

    def _remember_relayed(self, work: Work) -> None:
        if work.relay:
            self._relayed.put((work.did, work.kind), _digest(work))

    def _parsed(self, work: Work, kind: type[M]) -> M | None:
        """The frame's message, if it parses as ``kind`` (else counted as a reject, None)."""
        try:
            msg = parse_message(work.kind, work.uf.frame.body)
        except MessageError as exc:
            self.count("reject", exc.reason)
            return None
        return msg if isinstance(msg, kind) else None

    async def _identity_event(self, lane: _Lane, work: Work) -> PendingEvent | None:
        msg = self._parsed(work, IdentityMessage)
        if msg is None or self._relayed_again(work):
            return None
        await self.identity.purge(work.did)
        ident = await self.admission.identity_for_host(work.did, work.hostname, fresh=True, relay=work.relay)
        if ident is None:
            self.count("reject", _not_speaker(work))
            return None
        state = await self._admitted(lane, work)
        if state is None:
            return None
        verdict = validate_identity(msg, state, from_account_pds=True)
        self.count(verdict.kind, verdict.reason)
        if verdict.kind != "accept":
            return None
        verified = False
        self._later_handles.pop(work.did, None)  # this #identity supersedes any follow-up still due
        if msg.handle:
            check = self.identity.handle_check(msg.handle.lower(), work.did)
            done, _ = await asyncio.wait([check], timeout=self.handle_wait)
            if check in done:
                verified = check.result()
            else:  # a slow handle domain: pass the event on now, the handle once it verifies
                self._verify_later(work.did, work.uf.frame.body, check)
            if not verified:
                self.count("strip", Reason.HANDLE_NOT_VERIFIED)
        # An account first seen through its #identity is stored with its host, so it is admitted
        # (and counted against the host's limit) once, not again by its first commit.
        first_sight = state if lane.head is None else None
        event = PendingEvent(kind="#identity", did=work.did, body=identity_body(work.uf.frame.body, verified),
                             account=first_sight)
        self._advance(lane, event, first_sight or lane.head)
        self._remember_relayed(work)
        return event

    async def _account_event(self, lane: _Lane, work: Work) -> PendingEvent | None:
        msg = self._parsed(work, AccountMessage)
        if msg is None or self._relayed_again(work):
            return None
        # Status changes are rare and decisive: check the binding against a fresh DID document
        # (a cached one would let a host the account just left deactivate it).
        ident = await self.admission.identity_for_host(work.did, work.hostname, fresh=True, max_age=5.0,
                                                       relay=work.relay)
        if ident is None:
            self.count("reject", _not_speaker(work))
            return None
        state = await self._admitted(lane, work)
        if state is None:  # held: keep the status, emit nothing
            await self._quiet(lane)
            held = lane.durable
            if held is not None:
                verdict = validate_account(msg, held, self.clock())
                assert verdict.new_state is not None
                await self.sequencer.write_account(verdict.new_state)
                self._set_durable(lane, verdict.new_state)
            return None
        verdict = validate_account(msg, state, self.clock())
        self.count(verdict.kind, verdict.reason)
        new_state = verdict.new_state
        assert new_state is not None
        out = account_event_body(new_state)
        if isinstance(work.uf.frame.body.get("time"), str):
            out["time"] = work.uf.frame.body["time"]
        event = PendingEvent(kind="#account", did=work.did, body=out, account=new_state)
        self._advance(lane, event, new_state)
        self._remember_relayed(work)
        return event

    def _verify_later(self, did: str, body: dict[str, Any], check: asyncio.Future[bool]) -> None:
        """An ``#identity`` was passed on with its handle stripped while the handle's check was
        still running: if the check succeeds, and no later ``#identity`` of the account came
        meanwhile, emit an ``#identity`` carrying the verified handle (counted ``handle_verified_late``)."""
        token = object()
        self._later_handles[did] = token

        async def later() -> None:
            try:
                ok = await check
            except Exception:  # noqa: BLE001 - a failed check is an unverified handle
                ok = False
            if not ok:
                if self._later_handles.get(did) is token:
                    del self._later_handles[did]
                return

            async def op(lane: _Lane) -> None:
                if self._later_handles.pop(did, None) is not token:
                    return  # a later #identity came first
                self.count("accept", Reason.HANDLE_VERIFIED_LATE)
                await self.submit_own(lane, PendingEvent(kind="#identity", did=did,
                                                         body=identity_body(body, True)))

            await self.run_op(did, op)

        task = asyncio.get_running_loop().create_task(later(), name=f"handle-later:{did}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- operations ----------------------------------------------------------------------------
    async def set_local_status(self, did: str, local_status: str) -> AccountState:
        """Operator takedown / reversal: store it and emit ``#account`` with the combined status."""

        async def op(lane: _Lane) -> AccountState:
            state = lane.durable or AccountState(did=did)
            new_state = dataclasses.replace(state, local_status=local_status, updated_at=self.clock())
            # the new status and its #account are stored together, or neither
            await self.submit_own(lane, PendingEvent(kind="#account", did=did, body=account_event_body(new_state),
                                                     account=new_state))
            return new_state

        result: AccountState = await self.run_op(did, op)
        return result

    async def mark_for_resync(self, did: str, hostname: str | None) -> None:
        """Mark the account desynchronized and queue its resync (e.g. a held account released)."""

        async def op(lane: _Lane) -> None:
            await self._mark_desynchronized(lane, hostname or (lane.durable.host if lane.durable else None))

        await self.run_op(did, op)

    async def finish_resync(self, did: str, new_state: AccountState, sync_body: dict[str, Any],
                            collections: dict[str, int] | None = None) -> bool:
        """Emit the ``#sync`` of a completed resync (verified repository at ``new_state``), then
        judge the frames buffered meanwhile, in order, against it. Skipped (counted) when the
        account is synced by now at that rev or later (e.g. a Spark repair got there first).
        Refused (False: fetch again) when the lane already stored a newer rev while the account
        was desynchronized (lenient mode passes commits meanwhile): the relay never goes back.
        ``collections``: the repository's record counts per collection, stored with the ``#sync``."""

        async def op(lane: _Lane) -> bool:
            current = lane.durable
            state = new_state
            if current is not None:
                if current.rev is not None and state.rev is not None:
                    if current.sync_state == "synced" and state.rev <= current.rev:
                        self.count("ignore", Reason.COVERED_BY_RESYNC)
                        return True
                    if state.rev < current.rev:
                        return False
                state = dataclasses.replace(state, upstream_status=current.upstream_status,
                                            local_status=current.local_status)
            await self._install(lane, dataclasses.replace(state, sync_state="synced"), sync_body, collections)
            return True

        done: bool = await self.run_op(did, op)
        return done

    async def _install(self, lane: _Lane, state: AccountState, sync_body: dict[str, Any] | None,
                       collections: dict[str, int] | None = None) -> int | None:
        """Make ``state`` (a verified repository, ``synced``) the account's state: with a ``#sync``
        when ``sync_body`` is given and the account is active, else silently; then judge the
        frames buffered while it was being resynchronised. Returns the ``#sync``'s seq.
        ``collections`` (record counts per collection of the repository) go with the ``#sync``."""
        seq: int | None = None
        if sync_body is not None and state.active:
            stored = await self.submit_own(lane, PendingEvent(kind="#sync", did=lane.did, body=sync_body,
                                                              account=state, collections=collections))
            seq = stored.seq if stored is not None else None
        else:
            await self.sequencer.write_account(state)
            self._set_durable(lane, state)
        buffered, lane.buffer = lane.buffer, []
        self.resync.release_held(lane.did)
        for work in buffered:
            rev = str(work.uf.frame.body.get("rev", ""))
            if lane.head is not None and lane.head.rev is not None and rev <= lane.head.rev:
                self.count("ignore", Reason.COVERED_BY_RESYNC)
                continue
            head = lane.head
            assert head is not None and work.signing_key is not None
            verdict = await self._judge(work, head, work.signing_key)
            # judged again outside its run: sequenced without its fence and without moving
            # the host cursor (which went past it when it was buffered)
            work.fence = Fence()
            event = await self._apply(lane, work, head, verdict)
            if event is not None:
                await self.submit_own(lane, event)
            elif verdict.kind == "desync":
                lane.buffer = buffered[buffered.index(work) + 1:] + lane.buffer
                self.resync.add_held(lane.did, sum(len(w.uf.raw) + HELD_FRAME_OVERHEAD for w in lane.buffer))
                break  # marked again; a new resync is queued
        return seq

    async def apply_repair(self, repair: Repair) -> tuple[RepairOutcome, int | None]:
        """Apply one Spark outbox row in the account's lane, with ``backfill.outbox.decide_repair``'s
        compare-and-set against the durable state (nothing in flight); returns the outcome and the
        seq of the event it became (None when it became none)."""

        async def op(lane: _Lane) -> tuple[RepairOutcome, int | None]:
            durable = lane.durable
            outcome = decide_repair(repair, durable)
            self.count("repair", f"{repair.kind.lstrip('#')}_{outcome.value}")
            now = self.clock()
            if outcome == RepairOutcome.DESYNC_CLEARED:
                assert durable is not None
                await self._install(lane, dataclasses.replace(durable, sync_state="synced", updated_at=now), None)
                return outcome, None
            if outcome != RepairOutcome.APPLIED:
                return outcome, None
            if repair.kind == "add":  # an account the relay did not know: stored marked, resynced
                await self._mark_desynchronized(lane, repair.host, AccountState(
                    did=repair.did, host=repair.host, upstream_status=repair.upstream_status))
                return outcome, None
            assert durable is not None
            if repair.kind == "desync":
                await self._mark_desynchronized(lane, durable.host)
                return outcome, None
            if repair.kind == "#account":
                changed = dataclasses.replace(durable, upstream_status=repair.upstream_status, updated_at=now)
                stored = await self.submit_own(lane, PendingEvent(kind="#account", did=repair.did,
                                                                  body=account_event_body(changed), account=changed))
                return outcome, stored.seq if stored is not None else None
            assert repair.blocks is not None and repair.rev is not None
            body = {"did": repair.did, "blocks": repair.blocks, "rev": repair.rev, "time": now_iso()}
            return outcome, await self._install(lane, repaired_state(repair, durable, now), body, repair.collections)

        result: tuple[RepairOutcome, int | None] = await self.run_op(repair.did, op)
        return result
