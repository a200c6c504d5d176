"""Parallel validation over a process pool, preserving per-account order.

``ValidationPipeline.submit(did, frame, state, signing_key)`` returns a future of the
:class:`~firehose.validate.Verdict`. Events of *different* accounts are validated concurrently
on ``workers`` processes; events of the *same* account are chained: each waits for its
predecessor's verdict and is judged against the state that verdict produced (the parent keeps
the latest per-DID state, so an in-flight event is never judged against a stale stored state).
Callers that await the futures in submission order therefore see upstream order.

State merge: the caller passes the stored state (authoritative for statuses, which admins and
the resync worker change); the pipeline overlays its own newer ``rev``/``commit_cid``/
``data_cid``/``sync_state`` when it holds a more recent revision for that DID (bounded LRU).

Identity refresh: on ``bad_signature`` the optional ``refresh_key(did)`` is awaited once and,
if it yields a different key, the event is validated again (I-D §4.5: a failing signature may
be a recent key rotation).

``workers=0`` validates inline on the event loop (tests, tiny deployments); otherwise the
events go in batches to a :class:`firehose.workers.WorkerPool` (child processes fed through pipes
by the event loop itself). A worker that dies mid-batch is replaced and each event of that batch
is retried alone, so only the event that kills a worker is rejected (``validator_crashed``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from firehose.framing import FramingError, encode_unsequenced
from firehose.reasons import Reason
from firehose.state import AccountState, account_row
from firehose.validate import OUTGOING_FIELDS, Verdict, judge_frame, outgoing_body
from firehose.workers import WorkerDied, WorkerPool

RefreshKey = Callable[[str], Awaitable[str | None]]


Job = tuple[bytes, AccountState | None, str | None, float]
#: Completion of one queued job: ``(verdict, None)`` or ``(None, exception)``.
Done = Callable[[Verdict | None, BaseException | None], None]


def validate_and_encode(
    frame: bytes, state: AccountState | None, signing_key: str | None, now: float
) -> Verdict:
    """``validate_frame``, plus, for an accepted ``#commit``/``#sync``, the outgoing body
    (``firehose.validate.outgoing_body``: lexicon fields only, no upstream ``seq``, ``blocks``
    verbatim) encoded as canonical DAG-CBOR with the offset where ``seq`` belongs
    (``Verdict.body_cbor``/``seq_offset``, for ``PendingEvent``). Runs in a worker process, so
    the parent neither encodes the body nor receives it as a (large, slow to unpickle) dict."""
    verdict, decoded = judge_frame(frame, state, signing_key, now)
    if verdict.kind != "accept" or decoded is None or decoded.t not in OUTGOING_FIELDS:
        return verdict
    try:
        body_cbor, offset = encode_unsequenced(outgoing_body(decoded.t, decoded.body))
    except (FramingError, TypeError, ValueError):  # not expected after strict decoding
        return verdict  # the caller falls back to building the body itself
    return Verdict(verdict.kind, verdict.reason, verdict.new_state, verdict.detail, body_cbor, offset)


def _validate_job(frame: bytes, state: AccountState | None, signing_key: str | None, now: float) -> Verdict:
    """Inline (``workers=0``) validation."""
    return validate_and_encode(frame, state, signing_key, now)


# ``AccountState`` travels to the workers and back as ``account_row`` tuples: pickling slotted
# dataclasses runs Python-level ``__getstate__``/``__setstate__`` per object, a tuple is pickled in C.
WireJob = tuple[bytes, tuple[Any, ...] | None, str | None, float]
WireVerdict = tuple[str, str, tuple[Any, ...] | None, str, bytes | None, int | None]


def _to_wire(job: Job) -> WireJob:
    frame, state, key, now = job
    return frame, None if state is None else account_row(state), key, now


def _verdict_from_wire(w: WireVerdict) -> Verdict:
    kind, reason, state, detail, body_cbor, offset = w
    return Verdict(kind, reason, None if state is None else AccountState(*state), detail,  # type: ignore[arg-type]
                   body_cbor, offset)


def validate_batch(jobs: list[WireJob]) -> tuple[list[WireVerdict], float]:
    """Runs in a worker process: one round trip for several independent events. Returns the
    verdicts (as tuples) and the worker CPU seconds they took (exported as a metric)."""
    t0 = time.process_time()
    out: list[WireVerdict] = []
    for frame, state, key, now in jobs:
        v = validate_and_encode(frame, None if state is None else AccountState(*state), key, now)
        new_state = v.new_state
        out.append((v.kind, v.reason, None if new_state is None else account_row(new_state), v.detail,
                    v.body_cbor, v.seq_offset))
    return out, time.process_time() - t0


class ValidationPipeline:
    """See the module docstring. Use as ``async with ValidationPipeline(2) as p``."""

    def __init__(
        self,
        workers: int = 2,
        *,
        max_in_flight: int = 2048,
        max_batch: int = 32,
        refresh_key: RefreshKey | None = None,
        state_cache: int = 100_000,
        clock: Callable[[], float] = time.time,
        batch_timeout: float = 30.0,
    ) -> None:
        """``batch_timeout``: seconds a worker may take over one batch before it is killed (the
        batch's events are then retried alone, and one that hangs every time is rejected)."""
        self.workers = workers
        self.batch_timeout = batch_timeout
        self._pool: WorkerPool | None = None
        self._restarts = 0  # of pools already closed
        self._sem = asyncio.Semaphore(max_in_flight)
        self._tails: dict[str, asyncio.Future[Verdict]] = {}
        self._states: OrderedDict[str, AccountState] = OrderedDict()
        self._state_cache = state_cache
        self.refresh_key = refresh_key
        self.clock = clock
        self.identity_refreshes = 0
        self.max_batch = max_batch
        self._ready: list[tuple[Job, Done]] = []
        self._busy = 0  # batches in the workers
        self._dispatch_pending = False
        #: CPU seconds spent validating in worker processes (not counting inline mode)
        self.worker_cpu_s = 0.0

    @property
    def pool_restarts(self) -> int:
        """Worker processes replaced after dying."""
        return self._restarts + (self._pool.restarts if self._pool is not None else 0)

    @property
    def worker_pids(self) -> list[int]:
        return self._pool.pids if self._pool is not None else []

    async def start(self) -> None:
        if self.workers > 0 and self._pool is None:
            pool = WorkerPool(self.workers, batch_timeout=self.batch_timeout)
            await pool.start()
            self._pool = pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._restarts += self._pool.restarts
            self._pool = None

    async def __aenter__(self) -> ValidationPipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- per-DID state ------------------------------------------------------------------------
    def latest_state(self, did: str) -> AccountState | None:
        """The newest state the pipeline produced for ``did`` (None if not cached)."""
        return self._states.get(did)

    def forget(self, did: str) -> None:
        """Drop the cached state (after a resync or an admin change rewrote the stored one)."""
        self._states.pop(did, None)

    def _merge(self, did: str, stored: AccountState | None) -> AccountState | None:
        mine = self._states.get(did)
        if mine is None:
            return stored
        if stored is None:
            return mine
        if stored.rev is not None and (mine.rev is None or stored.rev >= mine.rev):
            return stored
        return replace(
            stored, rev=mine.rev, commit_cid=mine.commit_cid, data_cid=mine.data_cid, sync_state=mine.sync_state
        )

    def _remember(self, did: str, state: AccountState) -> None:
        self._states[did] = state
        self._states.move_to_end(did)
        while len(self._states) > self._state_cache:
            self._states.popitem(last=False)

    # -- submission -----------------------------------------------------------------------------
    # Per event there is no task: ``submit`` queues the job at once (or, when an earlier event of
    # the same account is still in flight, one small task waits for it first), the batch runner
    # calls ``_judged`` with the verdict, and ``_finish`` resolves the caller's future. Only the
    # rare identity-refresh retry runs as a task.
    async def submit(
        self,
        did: str,
        frame: bytes,
        state: AccountState | None,
        signing_key: str | None,
        now: float | None = None,
    ) -> asyncio.Future[Verdict]:
        """Queue one raw frame for ``did``; waits only when ``max_in_flight`` are queued."""
        await self._sem.acquire()
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        tails = self._tails
        prev = tails.get(did)
        tails[did] = fut
        if prev is None or prev.done():
            self._start(did, frame, state, signing_key, now, fut)
        else:  # judged once the predecessor's verdict (and state) is in
            prev.add_done_callback(functools.partial(self._start, did, frame, state, signing_key, now, fut))
        return fut

    async def validate(
        self, did: str, frame: bytes, state: AccountState | None, signing_key: str | None, now: float | None = None
    ) -> Verdict:
        """Submit and wait for the verdict."""
        return await (await self.submit(did, frame, state, signing_key, now))

    def _start(
        self,
        did: str,
        frame: bytes,
        state: AccountState | None,
        key: str | None,
        now: float | None,
        fut: asyncio.Future[Verdict],
        _prev: asyncio.Future[Verdict] | None = None,
    ) -> None:
        """Judge against the merged state: inline now, or queued for the next batch. Also the
        done-callback of the account's previous event (``_prev``, passed by the future, unused)."""
        try:
            job: Job = (frame, self._merge(did, state), key, self.clock() if now is None else now)
            if self._pool is None:
                self._judged(did, fut, job, _validate_job(*job), None)
                return
        except Exception as exc:
            self._finish(did, fut, None, exc)
            return
        self._ready.append((job, functools.partial(self._judged, did, fut, job)))
        self._dispatch_soon()

    def _dispatch_soon(self) -> None:
        """Dispatch at the end of this loop iteration, so the events submitted together (e.g. a
        burst read from one socket) leave in one batch rather than the first one alone."""
        if not self._dispatch_pending:
            self._dispatch_pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _judged(
        self, did: str, fut: asyncio.Future[Verdict], job: Job, verdict: Verdict | None, exc: BaseException | None
    ) -> None:
        if verdict is not None and verdict.reason == Reason.BAD_SIGNATURE and self.refresh_key is not None:
            asyncio.get_running_loop().create_task(self._retry_with_fresh_key(did, fut, job, verdict))
            return
        self._finish(did, fut, verdict, exc)

    async def _retry_with_fresh_key(self, did: str, fut: asyncio.Future[Verdict], job: Job, verdict: Verdict) -> None:
        """I-D §4.5: a failing signature may be a recent key rotation — refresh once and retry."""
        assert self.refresh_key is not None
        try:
            self.identity_refreshes += 1
            try:
                fresh = await self.refresh_key(did)
            except Exception:  # resolution failed: the verdict stands
                fresh = None
            frame, effective, key, t = job
            if fresh is not None and fresh != key:
                verdict = await self._call(frame, effective, fresh, t)
        except BaseException as exc:  # never leave a waiter hanging
            self._finish(did, fut, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._finish(did, fut, verdict, None)

    def _finish(
        self, did: str, fut: asyncio.Future[Verdict], verdict: Verdict | None, exc: BaseException | None
    ) -> None:
        try:
            if not fut.done():
                if verdict is None:
                    fut.set_exception(exc if exc is not None else RuntimeError("no verdict"))
                else:
                    if verdict.new_state is not None:
                        self._remember(did, verdict.new_state)
                    fut.set_result(verdict)
        finally:
            if self._tails.get(did) is fut:
                del self._tails[did]
            self._sem.release()

    async def _call(self, frame: bytes, state: AccountState | None, key: str | None, now: float) -> Verdict:
        """Validate one event, batched with whatever else is ready (one IPC round trip each)."""
        job: Job = (frame, state, key, now)
        if self._pool is None:
            return _validate_job(*job)
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._ready.append((job, functools.partial(_settle, fut)))
        self._dispatch()
        return await fut

    def _dispatch(self) -> None:
        # One batch per worker; a second one per worker only when it is full. While a worker is
        # busy, newly ready events accumulate, so batches grow with load (fewer IPC round trips)
        # and stay small (low latency) when the stream is quiet.
        self._dispatch_pending = False
        workers = max(1, self.workers)
        while self._ready and (
            self._busy < workers or (self._busy < 2 * workers and len(self._ready) >= self.max_batch)
        ):
            size = max(1, min(self.max_batch, -(-len(self._ready) // workers)))
            batch, self._ready = self._ready[:size], self._ready[size:]
            self._busy += 1
            asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[tuple[Job, Done]]) -> None:
        pool = self._pool
        try:
            assert pool is not None
            try:
                wire, cpu = await pool.run([_to_wire(j) for j, _ in batch])
                self.worker_cpu_s += cpu
                verdicts = [_verdict_from_wire(w) for w in wire]
            except WorkerDied:
                # A worker died (a poison frame or an outside kill; the pool has replaced it):
                # give each event of the batch its own attempt so only the culprit is rejected.
                # An event is blamed only after it took down workers on three attempts (another
                # worker killed at the same moment from outside must not condemn it).
                verdicts = []
                for job, _ in batch:
                    for _attempt in range(3):
                        try:
                            one, cpu = await pool.run([_to_wire(job)])
                        except WorkerDied:
                            continue
                        verdicts.extend(_verdict_from_wire(w) for w in one)
                        self.worker_cpu_s += cpu
                        break
                    else:
                        verdicts.append(Verdict("reject", Reason.VALIDATOR_CRASHED.value, None,
                                                "worker process died or hung on this event"))
        except BaseException as exc:
            for _, done in batch:
                done(None, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for (_, done), v in zip(batch, verdicts, strict=True):
                done(v, None)
        finally:
            self._busy -= 1
            self._dispatch()


def _settle(fut: asyncio.Future[Verdict], verdict: Verdict | None, exc: BaseException | None) -> None:
    if fut.done():
        return
    if verdict is None:
        fut.set_exception(exc if exc is not None else RuntimeError("no verdict"))
    else:
        fut.set_result(verdict)
