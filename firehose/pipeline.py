"""Validation in worker processes: ``await ValidationPool.judge(frame, state, key)`` → ``Verdict``.

A stateless service. It judges each frame against exactly the state it is given and keeps no
account state of its own: per-account order and the in-flight head belong to the account's lane
(``relay.ingest.lanes``), which asks for one verdict at a time per account. Judgements of different
accounts run concurrently and leave in batches (one IPC round trip each) to ``workers`` child
processes (:class:`firehose.workers.WorkerPool`, fed through pipes by the event loop itself);
``workers=0`` validates inline on the event loop (tests, tiny deployments). A worker that dies
mid-batch is replaced and each event of that batch is retried alone, so only the event that kills
a worker is rejected (``validator_crashed``); one that hangs past ``batch_timeout`` likewise.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from firehose.framing import FramingError, encode_unsequenced
from firehose.reasons import Reason
from firehose.state import AccountState, account_row, commit_op_changes
from firehose.validate import OUTGOING_FIELDS, Verdict, judge_frame, outgoing_body
from firehose.workers import WorkerDied, WorkerPool

Job = tuple[bytes, AccountState | None, str | None, float, bool]
#: Completion of one queued job: ``(verdict, None)`` or ``(None, exception)``.
Done = Callable[[Verdict | None, BaseException | None], None]


def validate_and_encode(
    frame: bytes, state: AccountState | None, signing_key: str | None, now: float, lenient: bool = False
) -> Verdict:
    """``validate_frame``, plus, for an accepted ``#commit``/``#sync``, the outgoing body
    (``firehose.validate.outgoing_body``: lexicon fields only, no upstream ``seq``, ``blocks``
    verbatim unless unreferenced blocks were dropped: ``Verdict.blocks``) encoded as canonical DAG-CBOR with the offset where ``seq`` belongs
    (``Verdict.body_cbor``/``seq_offset``, for ``PendingEvent``), and for a ``#commit`` the
    collections its ops touch (``Verdict.op_changes``). Runs in a worker process, so the parent
    neither encodes the body, nor receives it as a (large, slow to unpickle) dict, nor decodes its
    ops again for the collection counts.
    ``lenient``: sync 1.0 commits (``firehose.validate.validate_commit``)."""
    verdict, decoded = judge_frame(frame, state, signing_key, now, lenient=lenient)
    if verdict.kind != "accept" or decoded is None or decoded.t not in OUTGOING_FIELDS:
        return verdict
    body = decoded.body if verdict.blocks is None else {**decoded.body, "blocks": verdict.blocks}
    try:
        body_cbor, offset = encode_unsequenced(outgoing_body(decoded.t, body))
    except (FramingError, TypeError, ValueError):  # not expected after strict decoding
        return verdict  # the caller falls back to building the body itself
    changes = commit_op_changes(decoded.body.get("ops")) if decoded.t == "#commit" else None
    return Verdict(verdict.kind, verdict.reason, verdict.new_state, verdict.detail, body_cbor, offset, verdict.blocks,
                   changes)


# ``AccountState`` travels to the workers and back as ``account_row`` tuples: pickling slotted
# dataclasses runs Python-level ``__getstate__``/``__setstate__`` per object, a tuple is pickled in C.
WireJob = tuple[bytes, tuple[Any, ...] | None, str | None, float, bool]
WireVerdict = tuple[str, str, tuple[Any, ...] | None, str, bytes | None, int | None, bytes | None,
                    tuple[tuple[str, str], ...] | None]


def _to_wire(job: Job) -> WireJob:
    frame, state, key, now, lenient = job
    return frame, None if state is None else account_row(state), key, now, lenient


def _verdict_from_wire(w: WireVerdict) -> Verdict:
    kind, reason, state, detail, body_cbor, offset, blocks, changes = w
    return Verdict(kind, reason, None if state is None else AccountState(*state), detail,  # type: ignore[arg-type]
                   body_cbor, offset, blocks, changes)


def validate_batch(jobs: list[WireJob]) -> tuple[list[WireVerdict], float]:
    """Runs in a worker process: one round trip for several independent events. Returns the
    verdicts (as tuples) and the worker CPU seconds they took (exported as a metric)."""
    t0 = time.process_time()
    out: list[WireVerdict] = []
    for frame, state, key, now, lenient in jobs:
        v = validate_and_encode(frame, None if state is None else AccountState(*state), key, now, lenient)
        new_state = v.new_state
        out.append((v.kind, v.reason, None if new_state is None else account_row(new_state), v.detail,
                    v.body_cbor, v.seq_offset, v.blocks, v.op_changes))
    return out, time.process_time() - t0


class ValidationPool:
    """See the module docstring. Use as ``async with ValidationPool(2) as pool``."""

    def __init__(
        self,
        workers: int = 2,
        *,
        max_batch: int = 32,
        clock: Callable[[], float] = time.time,
        batch_timeout: float = 30.0,
    ) -> None:
        """``batch_timeout``: seconds a worker may take over one batch before it is killed (the
        batch's events are then retried alone, and one that hangs every time is rejected)."""
        self.workers = workers
        self.batch_timeout = batch_timeout
        self._pool: WorkerPool | None = None
        self._restarts = 0  # of pools already closed
        self.clock = clock
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

    async def __aenter__(self) -> ValidationPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def judge(
        self, frame: bytes, state: AccountState | None, signing_key: str | None, now: float | None = None, *,
        lenient: bool = False,
    ) -> asyncio.Future[Verdict]:
        """The verdict on ``frame`` against ``state`` (``validate_and_encode``), as a future: judged
        inline at once with ``workers=0``, else queued for the next batch (dispatched at the end of
        this loop iteration, so frames judged together leave together)."""
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        job: Job = (frame, state, signing_key, self.clock() if now is None else now, lenient)
        if self._pool is None:
            try:
                fut.set_result(validate_and_encode(*job))  # inline (workers=0)
            except Exception as exc:  # validate_and_encode never raises for bad input
                fut.set_exception(exc)
            return fut
        self._ready.append((job, functools.partial(_settle, fut)))
        if not self._dispatch_pending:
            self._dispatch_pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)
        return fut

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
