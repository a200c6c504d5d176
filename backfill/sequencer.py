"""The single writer: gives every verified event its ``seq`` and makes it durable.

``Sequencer(store, publish)`` takes ``PendingEvent``s from any number of tasks, groups them into
batches (up to ``max_batch`` events, or whatever arrived within ``max_delay`` seconds) and for
each batch, in one transaction:

* assigns consecutive seq numbers after the stored high-water mark (strictly increasing, in
  [1, 2**53), never reused: the mark lives in ``relay_meta`` and the write is conditional on it);
* stores each event's wire frame — ``frame_encoder(kind, {**body, "seq": seq})``, encoded once
  (or, for a ``PendingEvent`` carrying ``body_cbor``, ``seq`` spliced into those bytes);
* upserts the accounts' state and advances the hosts' upstream cursors.

Right after the commit it resolves the submitters' futures (the signal that the upstream cursor
may advance), then hands the batch to ``publish``. ``publish`` is awaited between commits, so it
must not wait on the network: the relay passes ``firehose.publisher.BusPublisher.publish``, which
queues the batch (bounded in bytes) for the bus and returns at once — a hung or dead bus never
slows sequencing. A re-delivered commit (an
event whose ``rev`` is not newer than the account's stored rev, e.g. replayed from an older
upstream cursor after a crash) is not sequenced: its ``submit`` returns ``None`` (its host
cursor still advances).

Exactly one sequencer may run per database (schema): ``start()`` takes the store's writer lease
(Postgres advisory lock / SQLite flock) and raises ``SequencerLockedError`` if another holds it
(or waits, with ``wait_for_lock=True``: ``state`` is ``waiting`` meanwhile, ``lease_holder`` names
the holder as the store tells it, and the wait is logged when it begins, every
``wait_log_interval`` seconds while the holder stays the same and whenever it changes).

Batch k+1 is deduplicated, numbered and encoded while batch k commits.

Failures. While the store is *unavailable* (``Store.is_transient``: connection lost or refused,
server restarting, database locked) nothing is failed: the batch is held and retried with capped
backoff (``retry_base`` doubling to ``retry_max``), the lease is re-taken when its connection died,
and a batch whose COMMIT did reach the database before the connection dropped is recognised by the
high-water mark and not written twice. Submitters queue behind it up to ``max_pending`` and then
wait (backpressure reaches the upstream sockets). ``state`` is ``retrying`` meanwhile. A commit
refused for any other reason fails that batch (its submitters get the error, batches numbered
behind it get ``BatchAbortedError``, nothing of them is stored) and numbering resumes from the
stored mark. Every failed submit's ``fence`` (``firehose.state.Fence``) is revoked before anything
else is numbered, and events whose fence is revoked are not stored (``FencedOffError``): once an
event of an upstream run is lost, nothing after it from that run is stored either, so the run can
re-read everything from its durable cursor. Only another writer (lease taken, mark moved) stops
the sequencer for good (``state == "failed"``).

Host cursors only move forward here (``GREATEST``): ``upstream_seq`` must be a value up to which
every upstream event of that host is sequenced, ignored or rejected (``advance_cursor`` covers
frames that produce no event); ``Store.set_host_cursor`` resets a cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from backfill.errors import (
    BatchAbortedError,
    SequencerClosedError,
    SequencerConflictError,
    SequencerLockedError,
)
from backfill.numbering import AccountWrite, CursorOnly, number_batch
from backfill.store import BatchWrite, Store, WriterLease, host_count_deltas
from firehose.backoff import backoff_delay
from firehose.state import AccountState, Fence, PendingEvent, SequencedEvent

log = logging.getLogger(__name__)

Publish = Callable[[list[SequencedEvent]], Awaitable[Any]]
FrameEncoder = Callable[[str, dict[str, Any]], bytes]


def _default_encoder() -> FrameEncoder:
    from firehose.frames import encode_frame

    return encode_frame


_STOP = object()


@dataclass(slots=True)
class _LeaseLost(Exception):
    """The writer lease was released during an outage and is not held yet (internal signal of
    ``Sequencer._commit_until_done``: take it again, never fail the batch for it)."""


class SequencerStats:
    batches: int = 0
    events: int = 0
    ignored: int = 0
    failed_batches: int = 0
    publish_errors: int = 0
    encode_errors: int = 0
    fenced: int = 0  # events not stored because their fence was revoked
    retries: int = 0  # store operations retried after a transient error


class Sequencer:
    """See the module docstring. Use as ``async with Sequencer(...) as seq:`` or call
    ``start()``/``close()``; ``submit`` starts it lazily."""

    def __init__(
        self,
        store: Store,
        publish: Publish,
        frame_encoder: FrameEncoder | None = None,
        *,
        max_batch: int = 1000,
        max_delay: float = 0.002,
        max_pending: int = 20000,
        wait_for_lock: bool = False,
        lock_timeout: float | None = None,
        clock: Callable[[], float] = time.time,
        retry_base: float = 0.05,
        retry_max: float = 2.0,
        wait_log_interval: float = 60.0,
    ) -> None:
        self.store = store
        self.publish = publish
        self.frame_encoder = frame_encoder or _default_encoder()
        self.max_batch = max_batch
        self.max_delay = max_delay
        self.wait_for_lock = wait_for_lock
        self.lock_timeout = lock_timeout
        self.clock = clock
        self.stats = SequencerStats()
        # A plain deque with two flags: cheaper per event than asyncio.Queue.
        self.max_pending = max_pending
        self._pending: deque[Any] = deque()
        self._has_items = asyncio.Event()
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._lease: WriterLease | None = None
        self._task: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self._high_water = 0  # last committed seq
        self._next_high_water = 0  # last seq numbered (committed or in flight)
        self._overlay: dict[str, tuple[str | None, str | None]] = {}  # did -> (host, rev) in flight
        self._epoch = 0  # bumped when a commit fails: batches numbered before are void
        self._numbering = asyncio.Event()  # cleared while recovering from a failed commit
        self._numbering.set()
        self._last_time = 0.0
        self._closed = False
        self._stopped = False  # the writer task has ended
        self._failure: BaseException | None = None
        #: while the store is unavailable: the error being retried (else None)
        self.unavailable: BaseException | None = None
        #: ``time.monotonic()`` of the last committed batch (or of start)
        self.last_commit_at = 0.0
        #: capped exponential backoff between retries while the store is unavailable (seconds)
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._outage_attempts = 0
        #: while ``start()`` waits for the writer lease: who holds it (``Store.writer_holder``)
        self.lease_holder: str | None = None
        self._waiting = False
        self.wait_log_interval = wait_log_interval
        #: called after each committed batch that changed hosts' account counts, with
        #: ``{hostname: change}`` (non-zero changes only); keeps an in-memory host board exact
        self.on_host_accounts: Callable[[dict[str, int]], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the writer lease, load the high-water mark and start the writer task."""
        async with self._start_lock:
            if self._task is not None:
                return
            if self._closed:
                raise SequencerClosedError("sequencer is closed")
            self._lease = await self._acquire_lease()
            self._high_water = self._next_high_water = await self._lease.high_water()
            # times never decrease along seq, even if the clock went back across a restart
            last = await self.store.read_after(self._high_water - 1, 1) if self._high_water else []
            self._last_time = last[0].time if last else 0.0
            self.last_commit_at = time.monotonic()
            self._task = asyncio.create_task(self._run(), name="sequencer")

    async def _acquire_lease(self) -> WriterLease:
        """The writer lease: at once, or (``wait_for_lock``) once the holder lets go, saying
        meanwhile whom this sequencer waits for."""
        try:
            return await self.store.acquire_writer(wait=False)
        except SequencerLockedError:
            if not self.wait_for_lock:
                raise
        started = time.monotonic()
        self.lease_holder = await self._holder()  # known before anyone sees the state "waiting"
        self._waiting = True
        waiter = asyncio.ensure_future(self.store.acquire_writer(wait=True, timeout=self.lock_timeout))
        logged: tuple[str | None, float] | None = None
        try:
            while True:
                now = time.monotonic()
                if logged is None or logged[0] != self.lease_holder or now - logged[1] >= self.wait_log_interval:
                    log.warning("sequencer: waiting for the writer lease (standby)",
                                extra={"holder": self.lease_holder, "waited_seconds": round(now - started, 1)})
                    logged = (self.lease_holder, now)
                await asyncio.wait({waiter}, timeout=min(5.0, self.wait_log_interval))
                if waiter.done():
                    break
                self.lease_holder = await self._holder()
            lease = waiter.result()
        finally:
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiter
            self._waiting = False
        log.warning("sequencer: writer lease taken", extra={"previous_holder": self.lease_holder,
                                                             "waited_seconds": round(time.monotonic() - started, 1)})
        self.lease_holder = None
        return lease

    async def _holder(self) -> str | None:
        try:
            return await self.store.writer_holder()
        except Exception as exc:  # noqa: BLE001 - only for the log and health: the wait goes on
            return f"unknown ({type(exc).__name__})"

    async def close(self) -> None:
        """Write everything already submitted, then release the lease (idempotent)."""
        self._closed = True
        if self._task is not None:
            if not self._task.done():
                self._pending.append(_STOP)  # may exceed max_pending by one: never blocks
                self._has_items.set()
            try:
                await self._task
            finally:
                self._task = None
        if self._lease is not None:
            await self._lease.release()
            self._lease = None

    async def __aenter__(self) -> Sequencer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def state(self) -> str:
        """``running``; ``retrying`` while the store is unavailable (batches held, nothing failed);
        ``failed`` after a fatal error (another writer took the lease or moved the high-water mark);
        ``waiting`` while ``start()`` waits for another writer's lease; ``stopped`` (never started,
        or closed)."""
        if self._failure is not None:
            return "failed"
        if self._waiting:
            return "waiting"
        if self._task is None or self._stopped:
            return "stopped"
        return "retrying" if self.unavailable is not None else "running"

    @property
    def failure(self) -> BaseException | None:
        """The fatal error that stopped this sequencer, if any."""
        return self._failure

    @property
    def high_water(self) -> int:
        """The last seq this sequencer has committed (or loaded at start)."""
        return self._high_water

    # -- submitting --------------------------------------------------------------------------
    async def enqueue(self, event: PendingEvent) -> asyncio.Future[SequencedEvent | None]:
        """Queue ``event`` (waiting for room when ``max_pending`` are queued) and return the
        future that ``submit`` would await. Lets one caller keep many events in flight while
        preserving its order."""
        if self._task is None or self._failure is not None or self._closed:
            await self._check_open()
        if len(self._pending) < self.max_pending and not self._stopped:
            return self._append(event)  # fast path: no coroutine hop per event
        fut: asyncio.Future[SequencedEvent | None] = asyncio.get_running_loop().create_future()
        await self._put((event, fut))
        return fut

    def enqueue_nowait(self, event: PendingEvent) -> asyncio.Future[SequencedEvent | None]:
        """``enqueue`` without waiting: for a caller that bounds what it has in flight itself (the
        host runs bound their frames in bytes), and must hand events over in a fixed order from
        a callback. Raises ``SequencerClosedError`` when the sequencer is not running."""
        if self._task is None or self._failure is not None or self._closed or self._stopped:
            raise SequencerClosedError(f"sequencer not running: {self._failure or self.state}")
        return self._append(event)

    def _append(self, event: PendingEvent) -> asyncio.Future[SequencedEvent | None]:
        fut: asyncio.Future[SequencedEvent | None] = asyncio.get_running_loop().create_future()
        self._pending.append((event, fut))
        if not self._has_items.is_set():
            self._has_items.set()
        return fut

    async def submit(self, event: PendingEvent) -> SequencedEvent | None:
        """Sequence ``event``; returns it once durable (published right after), or None if ignored as a
        re-delivery. Raises if its batch could not be written (nothing of it was stored)."""
        return await (await self.enqueue(event))

    async def advance_cursor(self, host: str, upstream_seq: int, fence: Fence | None = None) -> None:
        """Persist ``host``'s upstream cursor with the next batch (for frames that produced no
        event). Returns once durable; raises ``FencedOffError`` if ``fence`` was revoked first."""
        await self._check_open()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._put((CursorOnly(host, upstream_seq, fence), fut))
        await fut

    async def write_account(self, state: AccountState, fence: Fence | None = None) -> None:
        """Store ``state`` with the next batch, with no event; returns once durable. (The account
        lanes own account rows: they write every change through here or with an event.)"""
        await self._check_open()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._put((AccountWrite(state, fence), fut))
        await fut

    async def _put(self, item: tuple[Any, asyncio.Future[Any]]) -> None:
        while len(self._pending) >= self.max_pending and not self._stopped:
            self._has_room.clear()
            await self._has_room.wait()
        if self._stopped or self._closed:
            raise SequencerClosedError(f"sequencer stopped: {self._failure or 'closed'}")
        self._pending.append(item)
        if not self._has_items.is_set():
            self._has_items.set()

    async def _check_open(self) -> None:
        if self._failure is not None:
            raise SequencerClosedError(f"sequencer stopped: {self._failure}") from self._failure
        if self._closed:
            raise SequencerClosedError("sequencer is closed")
        if self._task is None:
            await self.start()

    # -- the writer --------------------------------------------------------------------------
    # Two stages overlap: while batch k is being committed (waiting on the database), batch k+1
    # is collected, checked for re-deliveries, numbered and encoded. Numbering is provisional
    # (``_next_high_water``) until commit; if a commit fails, every batch numbered after it is
    # failed too (its seqs assumed the failed batch) and numbering restarts from the stored mark.

    async def _run(self) -> None:
        ready: asyncio.Queue[_Prepared | None] = asyncio.Queue(maxsize=1)
        committer = asyncio.create_task(self._commit_loop(ready), name="sequencer-commit")
        try:
            stop = False
            while not stop and self._failure is None:
                items, stop = await self._collect()
                if not items:
                    continue
                if self._failure is not None:
                    self._fail_items(items, SequencerClosedError(f"sequencer stopped: {self._failure}"))
                    break
                prepared = await self._prepare(items)
                if prepared is not None:
                    await ready.put(prepared)
        finally:
            await ready.put(None)
            await committer
            self._stopped = True
            self._fail_pending(self._failure or SequencerClosedError("sequencer is closed"))

    async def _collect(self) -> tuple[list[tuple[Any, asyncio.Future[Any]]], bool]:
        """Up to ``max_batch`` queued items (waiting ``max_delay`` for a fuller batch)."""
        pending = self._pending
        while not pending:
            self._has_items.clear()
            await self._has_items.wait()
        if len(pending) < self.max_batch and self.max_delay > 0 and pending[0] is not _STOP:
            await asyncio.sleep(self.max_delay)
        items: list[tuple[Any, asyncio.Future[Any]]] = []
        stop = False
        while pending and len(items) < self.max_batch:
            item = pending.popleft()
            if item is _STOP:
                stop = True
                break
            items.append(item)
        if len(pending) < self.max_pending:
            self._has_room.set()
        return items, stop

    async def _prepare(self, items: list[tuple[Any, asyncio.Future[Any]]]) -> _Prepared | None:
        """Dedupe, number and encode one batch (no writes). Returns None if the batch failed."""
        dids: set[str] = set()
        add = dids.add
        for item, _ in items:
            if item.__class__ is CursorOnly:
                continue
            account = item.account
            if account is not None:
                add(account.did)
                add(item.did)
            elif item.rev:
                add(item.did)
        while True:
            await self._numbering.wait()  # not while a failed commit is being recovered
            epoch = self._epoch
            # Taken before the read: whatever commits meanwhile is in the database or in here.
            overlay = {did: self._overlay[did] for did in dids if did in self._overlay}
            # In-flight heads win over stored ones anyway: only ask the database for the rest.
            lookup = [did for did in dids if did not in overlay] if overlay else dids
            try:
                heads = await self.store.account_heads(lookup) if lookup else {}
            except Exception as exc:
                if self.store.is_transient(exc) and not self._closed:
                    await self._wait_for_store(exc)  # database unreachable: hold the batch
                    continue
                self._batch_failed(items, exc)
                return None
            self._store_back()
            if epoch != self._epoch or not self._numbering.is_set():
                continue
            heads.update(overlay)
            prepared = await self._number(items, heads, epoch)
            if prepared is not None:
                return prepared
            # A commit failed while this batch was being numbered: number it afresh.

    async def _number(
        self,
        items: list[tuple[Any, asyncio.Future[Any]]],
        heads: dict[str, tuple[str | None, str | None]],
        epoch: int,
    ) -> _Prepared | None:
        now = max(self.clock(), self._last_time + 1e-6)  # event times: whole µs, strictly increasing
        base = self._next_high_water
        numbered = await number_batch(items, heads, base=base, now=now, encode=self.frame_encoder)
        seq, accounts, cursors, last_rev = numbered.seq, numbered.accounts, numbered.cursors, numbered.last_rev
        rows, sequenced, results, errors = numbered.rows, numbered.sequenced, numbered.results, numbered.errors
        revved, ignored, encode_errors, fenced = numbered.revved, numbered.ignored, numbered.encode_errors, numbered.fenced

        if epoch != self._epoch or not self._numbering.is_set() or base != self._next_high_water:
            return None
        host_updates: dict[str, list[Any]] = {h: [c, now, 0] for h, c in cursors.items()}
        entries: dict[str, tuple[str | None, str | None]] = {}
        for did, state in accounts.items():
            head = heads.get(did)
            if head is None or head[0] != state.host:  # new account, or it moved host
                for host, delta in host_count_deltas(
                    head is not None, head[0] if head else None, state.host
                ).items():
                    host_updates.setdefault(host, [None, None, 0])[2] += delta
            entries[did] = (state.host, state.rev if state.rev is not None else last_rev.get(did))
        for did in revved:  # events with a rev but no account state
            rev = last_rev[did]
            if did not in entries and (did not in heads or heads[did][1] != rev):
                entries[did] = (heads[did][0] if did in heads else None, rev)
        # Later batches must see this one's accounts before it is committed.
        self._overlay.update(entries)
        self._next_high_water = seq
        self._last_time = numbered.last_time
        self.stats.ignored += ignored
        self.stats.encode_errors += encode_errors
        self.stats.fenced += fenced
        batch = BatchWrite(
            expected_high_water=base,
            new_high_water=seq,
            events=rows,
            accounts=list(accounts.values()),
            host_updates={h: (u[0], u[1], u[2]) for h, u in host_updates.items()},
            collection_resets=numbered.collections.resets,
            collection_deltas=numbered.collections.deltas(),
            upstream_done=numbered.upstream_done,
        )
        return _Prepared(
            epoch=epoch,
            batch=batch,
            items=items,
            sequenced=sequenced,
            results=results,
            errors=errors,
            entries=entries,
        )

    async def _commit_loop(self, ready: asyncio.Queue[_Prepared | None]) -> None:
        while True:
            prepared = await ready.get()
            if prepared is None:
                return
            if self._failure is not None:
                self._fail_items(prepared.items, SequencerClosedError(f"sequencer stopped: {self._failure}"))
                continue
            if prepared.epoch != self._epoch or prepared.batch.expected_high_water != self._high_water:
                self._batch_failed(prepared.items, BatchAbortedError("an earlier batch failed; resubmit"))
                continue
            await self._commit_until_done(prepared)

    async def _commit_until_done(self, prepared: _Prepared) -> None:
        """Commit one batch. While the store is unavailable (``Store.is_transient``) the batch is
        held and retried with capped backoff — nothing is failed, and later batches wait behind it
        (so submitters feel backpressure) — until it is committed or the sequencer is closed.
        A fatal error (another writer) stops the sequencer; any other error fails this batch."""
        while True:
            try:
                if self._lease is None:
                    # Released while the store was down (``_hold_lease``) and not taken again yet:
                    # take it, and learn whether the batch landed before the connection dropped.
                    raise _LeaseLost
                batch = prepared.batch
                if batch.events or batch.accounts or batch.host_updates or batch.upstream_done:
                    await self._lease.commit_batch(batch)
            except (SequencerLockedError, SequencerConflictError) as exc:
                self._fatal(exc, prepared)
                return
            except Exception as exc:
                lease_lost = isinstance(exc, _LeaseLost)
                if (not lease_lost and not self.store.is_transient(exc)) or self._closed:
                    await self._failed_commit(prepared, exc)
                    return
                if not lease_lost:
                    await self._wait_for_store(exc)
                try:
                    committed = await self._reconnect(prepared.batch)
                except (SequencerLockedError, SequencerConflictError) as fatal:
                    self._fatal(fatal, prepared)
                    return
                except Exception as again:
                    if not self.store.is_transient(again):
                        await self._failed_commit(prepared, again)
                        return
                    if lease_lost:  # still unavailable: back off before the next try
                        await self._wait_for_store(again)
                    continue  # still unavailable: wait and try again
                if not committed:
                    continue
            self._store_back()
            await self._committed(prepared)
            return

    async def _hold_lease(self) -> int:
        """The stored high-water mark, read through the lease; a lease whose connection died is
        released and taken again. Raises ``SequencerLockedError`` if another writer took it
        meanwhile, and the store's own (transient) error while it is still unavailable."""
        if self._lease is not None:
            try:
                return await self._lease.high_water()
            except Exception as exc:
                if not self.store.is_transient(exc):
                    raise
                with contextlib.suppress(Exception):
                    await self._lease.release()
                self._lease = None
        self._lease = await self.store.acquire_writer(wait=False)
        high = await self._lease.high_water()
        log.warning("sequencer: writer lease re-taken", extra={"high_water": high})
        return high

    async def _reconnect(self, batch: BatchWrite) -> bool:
        """After a transient failure: hold the lease again (``_hold_lease``) and tell whether
        ``batch`` was committed after all (the high-water mark moved to its end, e.g. the
        connection dropped after COMMIT). Raises ``SequencerConflictError`` if the mark is elsewhere."""
        high = await self._hold_lease()
        if high == batch.expected_high_water:
            return False
        if high == batch.new_high_water:
            return True
        raise SequencerConflictError(
            f"seq high-water mark is {high}, expected {batch.expected_high_water} or {batch.new_high_water}"
        )

    async def _wait_for_store(self, exc: BaseException) -> None:
        """The store is unavailable: note it (readiness, metrics, one log line per outage) and
        back off before the next attempt."""
        first = self.unavailable is None
        self.unavailable = exc
        self.stats.retries += 1
        self._outage_attempts = 1 if first else self._outage_attempts + 1
        if first:
            log.warning("store unavailable; holding batches and retrying",
                        extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
        delay = backoff_delay(self._outage_attempts - 1, self.retry_base, self.retry_max)
        await asyncio.sleep(delay)

    def _store_back(self) -> None:
        if self.unavailable is not None:
            log.warning("store available again; sequencing resumed",
                        extra={"retries": self._outage_attempts})
            self.unavailable = None

    def _fatal(self, exc: BaseException, prepared: _Prepared | None = None) -> None:
        """Stop for good (another writer); fail ``prepared``'s submits, if given."""
        self._failure = exc
        log.error("sequencer stopped: %s", exc)
        if prepared is not None:
            self._fail_items(prepared.items, exc)

    async def _failed_commit(self, prepared: _Prepared, exc: BaseException) -> None:
        """A commit refused for a reason retrying cannot fix: void every batch numbered after this
        one, re-sync with the database, and only then fail the batch (so what its submitters send
        next is numbered afresh). Their fences are revoked, so nothing after them is stored."""
        self._numbering.clear()
        self._epoch += 1
        self._overlay.clear()
        try:
            await self._recover()
        except (SequencerLockedError, SequencerConflictError) as fatal:
            self._fatal(fatal)
        self._next_high_water = self._high_water
        self._numbering.set()
        self._batch_failed(prepared.items, exc)

    async def _committed(self, prepared: _Prepared) -> None:
        batch = prepared.batch
        self._high_water = batch.new_high_water
        self.last_commit_at = time.monotonic()
        for did, entry in prepared.entries.items():
            if self._overlay.get(did) == entry:
                del self._overlay[did]  # the database has it now
        self.stats.batches += 1
        self.stats.events += len(prepared.sequenced)
        on_host_accounts = self.on_host_accounts
        if on_host_accounts is not None and batch.host_updates:
            deltas = {h: u[2] for h, u in batch.host_updates.items() if u[2]}
            if deltas:
                on_host_accounts(deltas)
        for fut, result in prepared.results:
            if not fut.done():
                fut.set_result(result)
        for fut, exc in prepared.errors:
            if not fut.done():
                fut.set_exception(exc)
        if prepared.sequenced:  # durable and confirmed already: publishing is not on that path
            try:
                await self.publish(prepared.sequenced)
            except Exception:  # consumers fill the hole from the store
                self.stats.publish_errors += 1
                log.exception("publishing %d sequenced events failed", len(prepared.sequenced))

    def _fail_pending(self, exc: BaseException) -> None:
        while self._pending:
            item = self._pending.popleft()
            if item is not _STOP:
                self._fail_items([item], SequencerClosedError(f"sequencer stopped: {exc}"))
        self._has_room.set()  # wake blocked enqueuers: they see the sequencer stopped

    @staticmethod
    def _fail_items(items: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException) -> None:
        """Fail these submits; each one's fence is revoked first (synchronously, before anything
        else is numbered), so no later event of the same run is stored after a lost one."""
        reason = getattr(exc, "reason", None) or type(exc).__name__
        for item, fut in items:
            fence = item.fence
            if fence is not None:
                fence.revoke(str(reason))
            if not fut.done():
                fut.set_exception(exc)

    def _batch_failed(self, items: list[tuple[Any, asyncio.Future[Any]]], exc: BaseException) -> None:
        self.stats.failed_batches += 1
        log.warning("sequencer batch of %d not written: %s", len(items), exc)
        self._fail_items(items, exc)

    async def _recover(self) -> None:
        """After a refused write: the commit may or may not have happened, and the lease may be
        gone. Reload the high-water mark through the lease (``_hold_lease``), waiting while the
        store is unavailable — an outage during recovery is not a reason to stop for good."""
        while True:
            try:
                self._high_water = await self._hold_lease()
            except SequencerLockedError:
                raise
            except Exception as exc:
                if self.store.is_transient(exc) and not self._closed:
                    await self._wait_for_store(exc)
                    continue
                raise SequencerConflictError(f"writer lease lost and not recoverable: {exc}") from exc
            self._store_back()
            return


@dataclass(slots=True)
class _Prepared:
    """One numbered, encoded batch waiting for its commit."""

    epoch: int
    batch: BatchWrite
    items: list[tuple[Any, asyncio.Future[Any]]]
    sequenced: list[SequencedEvent]
    results: list[tuple[asyncio.Future[Any], SequencedEvent | None]]
    errors: list[tuple[asyncio.Future[Any], BaseException]]
    entries: dict[str, tuple[str | None, str | None]]
