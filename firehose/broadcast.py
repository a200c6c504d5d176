"""Downstream delivery: per-consumer replay-then-live with the I-D §4.3 cursor rules.

Transport-agnostic core. :class:`Broadcaster` owns one bus subscription and fans each event
(its stored ``frame`` bytes: encoded once, shared by every consumer) out to the registered
:class:`ConsumerSession` objects. A transport adapter (``firehose.serve_asgi`` for Starlette,
``firehose.serve_websockets`` for a plain ``websockets`` server) pulls frames from
:meth:`ConsumerSession.frame_batches` (lists: one per replay store read, or what is queued live)
and sends them. The two classes talk through small public methods only: a running session is
registered (:meth:`Broadcaster.register`/``unregister``), the fan-out hands it each live batch
(:meth:`ConsumerSession.offer`) and wakes it on close (:meth:`ConsumerSession.wake`).

Cursor rules (exclusive, as Bluesky's relay and PDS count them and as the I-D's reconnect rule
implies: a consumer reconnects with "the last sequence number they successfully processed"):

* no cursor — live only, from the moment of connection;
* ``cursor > latest seq`` — ``FutureCursor`` error frame, then close;
* ``cursor == latest seq`` — nothing to replay: the next event, then live;
* ``cursor == 0`` — the whole window from the oldest stored event, then live;
* ``cursor < oldest - 1`` (events the consumer has not seen were trimmed) — ``#info
  OutdatedCursor``, then the whole window, then live;
* otherwise — every stored event with ``seq > cursor``, then live.

No gap, no duplicate at the replay→live handoff: a session registers for live events
*before* its first store read and buffers them (bounded); when a store read comes back short
(caught up) the switch to live happens without an intervening ``await``; from then on any
event with ``seq <= last sent`` is dropped — when taken from the queue (``_take_queued``) or
written directly (``_offer_direct``) — since the store can show an event before the bus delivers
it, so a replayed event may still arrive live, before or after the switch. Every event published after registration is in the
buffer; every event published before it was durable before it, hence visible to the reads.

A catching-up consumer is never dropped for falling behind: if its buffer overflows during replay
the buffer is discarded and replay simply continues from the store (which has everything). Replay
reads of all sessions share one :class:`ReplayBudget` in bytes (see there and
:meth:`Broadcaster.read_share`); only a replaying session whose connection has not taken its batch
within ``max_lag`` while other reads wait for that budget is cut as too slow. A *live* consumer
is too slow — sent ``ConsumerTooSlow``, then closed — when it lags behind live:

* in time: an event was handed to its connection and the connection has not taken it within
  ``max_lag`` seconds. A transport that can probe (``pump(probe=…)``: a WebSocket ping sent after
  the data, whose pong proves the peer read everything before it) is probed after live writes, at
  most every ``max_lag / 4``; the probe's deadline is ``max_lag`` after the first write it covers.
  So a consumer that stops reading is told within ``max_lag`` of the first event it does not
  take, at any event rate (at a low rate the event sits in socket buffers, where no queue limit
  would ever see it);
* in bytes or frames: its live queue in this process overflows (``live_queue_max`` frames /
  ``live_queue_bytes`` bytes), which at a high rate happens first.
Memory per consumer is bounded by ``live_queue_max`` frames / ``live_queue_bytes`` bytes plus two
replay batches (the one being sent and the next store read, done ahead while it is sent), and the
replay batches of all consumers together by the replay budget (plus what their sockets have not
sent yet: at most one read share each).
Replay is sent one store read at a time (:meth:`ConsumerSession.frame_batches`), so a transport
can write a whole batch at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from firehose.backoff import Backoff
from firehose.budget import ByteBudget
from firehose.bus import BusClosed, EventBus, Subscription
from firehose.frames import encode_error_frame, encode_info_frame
from firehose.serve_wire import WireBatch
from firehose.state import SequencedEvent

log = logging.getLogger(__name__)

#: Default bound on a live consumer's lag (``Broadcaster(max_lag=)``, ``RELAY_CONSUMER_MAX_LAG``).
DEFAULT_MAX_LAG = 15.0
#: Default replay budget (``Broadcaster(replay_budget_bytes=)``, ``RELAY_REPLAY_BUFFER_MB``).
DEFAULT_REPLAY_BUDGET = 128 * 1024 * 1024

FUTURE_CURSOR = "FutureCursor"
CONSUMER_TOO_SLOW = "ConsumerTooSlow"
OUTDATED_CURSOR = "OutdatedCursor"
#: Kinds of the session's own messages in :meth:`ConsumerSession.event_batches`.
INFO_KIND = "#info"
ERROR_KIND = "#error"


def _control(kind: str, frame: bytes) -> SequencedEvent:
    return SequencedEvent(0, "", kind, 0.0, frame)


class ReplayStore(Protocol):
    """The part of ``backfill.store.Store`` the broadcaster reads."""

    async def read_after(self, seq: int, limit: int = ...) -> list[SequencedEvent]:
        """Events with ``seq > seq`` in ascending order, at most ``limit``."""
        ...

    async def oldest_seq(self) -> int | None: ...

    async def latest_seq(self) -> int | None: ...


@dataclass(slots=True)
class BroadcastStats:
    """Counters exposed for metrics."""

    consumers: int = 0
    too_slow: int = 0
    future_cursor: int = 0
    outdated_cursor: int = 0
    replay_overflows: int = 0
    bus_gaps_filled: int = 0
    bus_errors: int = 0
    #: consumers cut as too slow because a lag probe was not answered in time (also in ``too_slow``)
    lagged: int = 0
    #: replay reads that waited in line for the replay budget (:class:`ReplayBudget`)
    replay_waits: int = 0
    #: replaying consumers cut as too slow: their connection took no batch within ``max_lag``
    #: while others waited for the replay budget (also in ``too_slow``)
    replay_stalled: int = 0
    #: the replay budget (bytes): its limit, what replaying sessions hold now, the most they held
    replay_budget_limit: int = 0
    replay_budget_used: int = 0
    replay_budget_peak: int = 0


class ReplayBudget(ByteBudget):
    """Bytes of replay reads held by all replaying sessions of one broadcaster, at most ``limit``.

    A session takes a read's expected size (:meth:`take`) before it asks the store, settles on
    the read's real size when it comes back (:meth:`settle`: a read larger than expected is kept,
    and the line waits until it is given back), and gives it back once the batch has been handed
    to its connection (:meth:`give`). A take that does not fit waits in line; reads of sessions that
    hold nothing go before reads ahead of sessions that already hold a batch, each kind in arrival
    order, and the head of the line is never overtaken: so n replaying sessions take turns, and
    more replayers mean each waits longer, never more memory. A take larger than the whole budget
    is granted when nothing is held, so it cannot wait forever. Event-loop code only."""

    def __init__(self, limit: int, stats: BroadcastStats, on_wait: Callable[[], None] = lambda: None) -> None:
        """``on_wait()`` is called whenever a take has to wait in line."""
        if limit < 1:
            raise ValueError("the replay budget must be at least one byte")
        super().__init__(limit, lines=2)  # [0]: sessions that hold nothing, [1]: reads ahead
        self._stats = stats
        self._on_wait = on_wait
        stats.replay_budget_limit = limit

    def _add(self, n: int) -> None:
        super()._add(n)
        stats = self._stats
        stats.replay_budget_used = self.used
        if self.used > stats.replay_budget_peak:
            stats.replay_budget_peak = self.used

    def _waits(self) -> None:
        self._stats.replay_waits += 1
        self._on_wait()

    async def take(self, n: int, *, ahead: bool = False, line: int = 0) -> None:
        """Wait until ``n`` bytes fit, in line (``ahead``: the session already holds a batch)."""
        await super().take(n, line=1 if ahead else line)

    def settle(self, taken: int, real: int) -> None:
        """A read taken as ``taken`` bytes came back with ``real``: hold ``real`` instead."""
        if real >= taken:
            self._add(real - taken)
        else:
            self.give(taken - real)


#: One replay read: its events (or their frames), first and last seq (0: none), bytes, limit.
_Read = tuple[list[Any], int, int, int, int]


class ConsumerSession:
    """One downstream connection's state. Create with :meth:`Broadcaster.session`."""

    def __init__(self, broadcaster: Broadcaster, cursor: int | None) -> None:
        self._b = broadcaster
        self.cursor = cursor
        self._live = cursor is None
        self._queue: deque[SequencedEvent] = deque()
        self._queued_bytes = 0
        self._replay_overflow = False
        self._wake = asyncio.Event()
        #: Set when the live queue overflowed; the transport must send :attr:`close_frame` and close.
        self.too_slow = asyncio.Event()
        self.close_frame: bytes | None = None
        self.last_seq: int | None = None
        self.sent = 0
        #: Bytes of the frames handed to the transport (``sent`` counts them).
        self.bytes_sent = 0
        #: Optional synchronous writer (see :class:`DirectWriter`); once the live queue is drained
        #: the fan-out calls it directly, skipping the per-frame task switch.
        self.direct_writer: DirectWriter | None = None
        self._direct = False
        #: When the oldest live write not yet covered by a lag probe was made (None: none pending).
        self._unprobed_since: float | None = None
        self._written = asyncio.Event()
        #: Replay budget bytes this session holds (the batch handed over, the read ahead).
        self._replay_held = 0
        #: When the replay batch now with the connection was handed over (None: none is).
        self._handed_at: float | None = None

    # -- called by the broadcaster's fan-out (synchronously, never awaits)
    def offer(self, batch: list[SequencedEvent], wire: WireBatch | None = None) -> None:
        """A live batch (ascending seq): written at once through :attr:`direct_writer` once the
        session is in direct mode, else queued (bounded) for :meth:`frame_batches`. ``wire``:
        the batch's frames as a :class:`WireBatch` shared by every session (built if absent)."""
        if self._direct:
            self._offer_direct(batch, wire)  # one write per consumer per batch
        else:
            for ev in batch:
                self._offer(ev)

    @property
    def live(self) -> bool:
        """Replay (if any) is over: this session is sent live events now."""
        return self._live

    def wake(self) -> None:
        """Make a waiting :meth:`frame_batches` look again (the broadcaster is closing)."""
        self._wake.set()

    def _offer(self, ev: SequencedEvent) -> None:
        if self.too_slow.is_set():
            return
        b = self._b
        if self._direct:
            self._offer_direct([ev])
            return
        size = len(ev.frame)
        if len(self._queue) >= b.live_queue_max or self._queued_bytes + size > b.live_queue_bytes:
            if self._live:
                self._overflowed_live()
                return
            # catching up: forget the buffer, the store has these events
            if not self._replay_overflow:
                b.stats.replay_overflows += 1
            self._replay_overflow = True
            self._queue.clear()
            self._queued_bytes = 0
            return
        self._queue.append(ev)
        self._queued_bytes += size
        self._wake.set()

    def _offer_direct(self, batch: list[SequencedEvent], wire: WireBatch | None = None) -> None:
        last = self.last_seq
        if last is not None and batch[0].seq <= last:
            batch = [e for e in batch if e.seq > last]
            if not batch:
                return
            wire = None  # a subset: not the shared batch
        assert self.direct_writer is not None
        if wire is None:
            wire = WireBatch([e.frame for e in batch])
        if not self.direct_writer.write(wire):
            self._overflowed_live()
            return
        self.last_seq = batch[-1].seq
        self.sent += len(batch)
        self.bytes_sent += wire.nbytes
        self._note_written()

    def _note_written(self) -> None:
        """Live frames went to the transport: the next lag probe covers them."""
        if self._unprobed_since is None:
            self._unprobed_since = self._b.clock()
            self._written.set()

    def _overflowed_live(self) -> None:
        self._too_slow("live queue overflowed")

    def _lagged(self) -> None:
        self._b.stats.lagged += 1
        self._too_slow(f"more than {self._b.max_lag:g} s behind live")

    def stalled_replay(self) -> None:
        """Cut this replaying session: its connection has not taken its batch within ``max_lag``
        while other sessions wait for the replay budget."""
        self._too_slow(f"took no replay batch for {self._b.max_lag:g} s while others waited to replay")

    def _too_slow(self, why: str) -> None:
        if self.too_slow.is_set():
            return
        self.close_frame = encode_error_frame(CONSUMER_TOO_SLOW, why)
        self._b.stats.too_slow += 1
        self._queue.clear()
        self._queued_bytes = 0
        self._direct = False
        self.too_slow.set()
        self._wake.set()

    async def frame_batches(self) -> AsyncGenerator[list[bytes], None]:
        """Yield the frames to send, in order, as non-empty lists: during replay one list per
        store read (bounded by ``replay_batch`` / ``replay_bytes``), live whatever is queued
        (at most ``replay_batch`` frames / ``replay_bytes`` bytes per list). Ends after an
        error frame or on close. The session counts a list as sent when it is yielded. Replayed
        events are kept as their frames alone from the moment they are read (see :meth:`_replay`)."""
        batches = self._batches(frames=True)
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()

    async def event_batches(self) -> AsyncGenerator[list[SequencedEvent], None]:
        """:meth:`frame_batches` as the events themselves (for transports that send something
        derived from each event, e.g. the JSON stream). The session's own messages (``#info``
        OutdatedCursor, the ``#error`` that ends it) are events of kind :data:`INFO_KIND` /
        :data:`ERROR_KIND` with seq 0 and the encoded frame."""
        batches = self._batches(frames=False)
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()

    async def _batches(self, *, frames: bool) -> AsyncGenerator[list[Any], None]:
        """The body of :meth:`frame_batches` (``frames``: lists of frames) and
        :meth:`event_batches` (lists of events)."""
        b = self._b
        b.register(self)
        try:
            if self.cursor is not None:
                replay = self._replay(frames=frames)
                try:
                    async for items in replay:
                        yield items
                finally:
                    await replay.aclose()  # closed mid-replay: cancels the read ahead now
                if self.close_frame is not None:
                    yield [self.close_frame] if frames else [_control(ERROR_KIND, self.close_frame)]
                    return
            while True:
                while not self._queue:
                    if self.too_slow.is_set() or b.closed:
                        break
                    if self.direct_writer is not None:
                        self._direct = True  # queue drained: the fan-out writes from now on
                    self._wake.clear()
                    await self._wake.wait()
                if self.too_slow.is_set() or (b.closed and not self._queue):
                    break
                batch = self._take_queued()
                if batch:
                    yield [ev.frame for ev in batch] if frames else batch
            # ConsumerTooSlow is sent by ``pump`` (the transport may be stalled mid-send).
        finally:
            b.unregister(self)

    def _take_queued(self) -> list[SequencedEvent]:
        """Pop queued live events (bounded like one replay batch), skipping any already sent."""
        b = self._b
        queue = self._queue
        last = self.last_seq
        out: list[SequencedEvent] = []
        size = 0
        while queue and len(out) < b.replay_batch and size < b.replay_bytes:
            ev = queue.popleft()
            n = len(ev.frame)
            self._queued_bytes -= n
            if last is not None and ev.seq <= last:
                continue  # replayed from the store before the bus delivered it
            last = ev.seq
            out.append(ev)
            size += n
        if out:
            self.last_seq = last
            self.sent += len(out)
            self.bytes_sent += size
            self._note_written()
        return out

    async def watch_lag(self, probe: ProbeFn) -> None:
        """Probe the connection after live writes (see the module docstring); mark the session too
        slow when a probe is not answered within ``max_lag`` of the first write it covers. Ends
        then, or when ``probe`` raises (the connection is gone); the caller cancels it otherwise."""
        b = self._b
        interval = b.max_lag / 4
        while True:
            await self._written.wait()
            self._written.clear()
            since = self._unprobed_since
            self._unprobed_since = None
            if since is None:
                continue
            sent_at = b.clock()
            try:
                await asyncio.wait_for(probe(), max(since + b.max_lag - sent_at, 0.0))
            except TimeoutError:
                self._lagged()
                return
            except Exception:  # the connection is gone: the transport ends the session
                return
            pause = sent_at + interval - b.clock()
            if pause > 0:
                await b.sleep(pause)  # probes are paced; writes meanwhile keep their deadline

    async def _replay(self, *, frames: bool) -> AsyncGenerator[list[Any], None]:
        """The replay: lists of events, or of their frames alone (``frames``: each store read is
        turned into its frames at once, so the small objects of a read (an event, its seq, DID,
        kind and time) live only while it is converted, not while it waits in the budget: a
        replay crowd then leaves far fewer small-object arenas behind, which CPython's allocator
        cannot give back while any block in them lives)."""
        b = self._b
        cursor = self.cursor
        assert cursor is not None
        latest = await b.store.latest_seq() or 0
        if cursor > latest:
            b.stats.future_cursor += 1
            self.close_frame = encode_error_frame(FUTURE_CURSOR, "cursor is ahead of the stream")
            return
        oldest = await b.store.oldest_seq()
        if cursor == 0:
            last = 0
        elif cursor == latest:
            # what a consumer that processed the latest event reconnects with: nothing to
            # replay, it waits for the next event
            last = latest
        elif oldest is None or cursor < oldest - 1:
            b.stats.outdated_cursor += 1
            info = encode_info_frame(OUTDATED_CURSOR, "cursor is older than the backfill window")
            yield [info] if frames else [_control(INFO_KIND, info)]
            last = 0
        else:
            last = cursor  # every stored event with seq > cursor
        # The next store read runs while the current batch is being sent (at most two batches
        # held: the one handed to the connection and the one read ahead), each read taken from the
        # replay budget first and given back once its batch is handed over.
        b.replaying += 1
        read: asyncio.Future[_Read] | None = None
        try:
            read = asyncio.ensure_future(self._read_after(last, None, ahead=False, frames=frames))
            while True:
                assert read is not None
                events, first, final, size, read_limit = await read
                read = None
                out: list[Any] = []
                if events and last > 0 and first > last + 1:
                    # Retention trimmed the window past this (slow) consumer: say so, never a
                    # silent gap (the same #info a too-old cursor gets at connection time). The
                    # jump itself is the proof: seqs are dense (``number_batch`` numbers every
                    # stored event, one more than the last) and ``trim`` deletes a prefix.
                    b.stats.outdated_cursor += 1
                    info = encode_info_frame(OUTDATED_CURSOR, "events were trimmed while replaying")
                    out.append(info if frames else _control(INFO_KIND, info))
                avg: int | None = None
                if events:  # ascending, all past ``last`` (``read_after``'s contract)
                    avg = b.frame_estimate = max(1, size // len(events))
                    last = final
                    out.extend(events)
                    self.last_seq = last
                    self.sent += len(events)
                    self.bytes_sent += size
                full = len(events) >= read_limit
                if full:
                    read = asyncio.ensure_future(self._read_after(last, avg, ahead=size > 0, frames=frames))
                if out:
                    self._handed_at = b.clock()
                    yield out
                    self._handed_at = None
                self._give_replay(size)  # handed to the connection (or nothing was read)
                del out, events
                if full:
                    continue
                # Caught up. No await between this check and the switch to live.
                if self._replay_overflow:
                    self._replay_overflow = False
                    read = asyncio.ensure_future(self._read_after(last, avg, ahead=False, frames=frames))
                    continue
                self._live = True  # what is queued and was replayed is skipped by _take_queued
                return
        finally:
            b.replaying -= 1
            self._handed_at = None
            if read is not None and not read.done():  # closed mid-replay: drop the read ahead
                read.cancel()  # (it gives back what it took itself)
            elif read is not None and not read.cancelled():
                read.exception()  # retrieved, so a failed read ahead is not reported as lost
            self._give_replay(self._replay_held)

    async def _read_after(self, after: int, avg: int | None, *, ahead: bool, frames: bool) -> _Read:
        """One replay store read of about :meth:`Broadcaster.read_share` bytes (frames estimated
        at ``avg`` bytes, this session's last read, else the broadcaster's), taken from the replay
        budget first; returns the events (``frames``: their frames alone), the first and last seq
        read (0 if none), their bytes (held by this session until given back) and the read's limit."""
        b = self._b
        frame = avg or b.frame_estimate or max(1, b.replay_bytes // b.replay_batch)
        limit = max(1, min(b.replay_batch, b.read_share() // frame))
        taken = limit * frame
        await b.replay_budget.take(taken, ahead=ahead)
        try:
            events = await b.store.read_after(after, limit)
        except BaseException:
            b.replay_budget.give(taken)
            raise
        first = events[0].seq if events else 0
        final = events[-1].seq if events else 0
        items: list[Any] = [e.frame for e in events] if frames else events
        del events
        size = sum(map(len, items)) if frames else sum(len(e.frame) for e in items)
        b.replay_budget.settle(taken, size)
        self._replay_held += size
        return items, first, final, size, limit

    def _give_replay(self, n: int) -> None:
        if n:
            self._replay_held -= n
            self._b.replay_budget.give(n)

    @property
    def replay_stalled_since(self) -> float | None:
        """When this replaying session handed its connection the batch it has not taken yet (None:
        it is not waiting on its connection)."""
        return self._handed_at


class DirectWriter(Protocol):
    """A transport that can take frames synchronously (e.g. a ``websockets`` connection:
    the frames go straight into its write buffer). ``write`` returns False when the transport's
    buffer is over the consumer's limit: the consumer is then too slow. The batch is shared by
    every consumer (:meth:`WireBatch.wire` is framed once for all of them)."""

    def write(self, batch: WireBatch) -> bool: ...


class Broadcaster:
    """Fan-out from one bus subscription to many consumer sessions."""

    def __init__(
        self,
        store: ReplayStore,
        bus: EventBus,
        *,
        live_queue_max: int = 10_000,
        live_queue_bytes: int = 64 * 1024 * 1024,
        replay_batch: int = 500,
        replay_bytes: int = 4 * 1024 * 1024,
        replay_budget_bytes: int = DEFAULT_REPLAY_BUDGET,
        max_consumers: int = 10_000,
        max_lag: float = DEFAULT_MAX_LAG,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``max_lag``: seconds a live consumer's connection may take to take an event (see the
        module docstring); ``live_queue_max``/``live_queue_bytes``: its live queue in this process;
        ``clock``/``sleep``: the time the lag probes are paced and judged by. ``replay_bytes``: what
        one replay read asks for (fewer frames when larger); ``replay_budget_bytes``: what all
        replaying sessions together may hold (:class:`ReplayBudget`; each read asks for at most an
        equal share of it, half of it divided by the replaying sessions)."""
        if max_lag <= 0:
            raise ValueError("max_lag must be positive")
        self.max_lag = max_lag
        self.clock = clock
        self.sleep = sleep
        self.store = store
        self.bus = bus
        self.live_queue_max = live_queue_max
        self.live_queue_bytes = live_queue_bytes
        self.replay_batch = replay_batch
        self.replay_bytes = replay_bytes
        self.max_consumers = max_consumers
        self.stats = BroadcastStats()
        self.replay_budget = ReplayBudget(replay_budget_bytes, self.stats, on_wait=self._watch_stalled_replays)
        #: Sessions replaying now (reading the store).
        self.replaying = 0
        #: The average frame of the last replay read (what a session's first read expects).
        self.frame_estimate: int | None = None
        self._stall_watch: asyncio.Task[None] | None = None
        self._sessions: set[ConsumerSession] = set()
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._last_seq: int | None = None

    def read_share(self) -> int:
        """Bytes one replay read asks for now: ``replay_bytes``, or less when that many replaying
        sessions could not each hold two reads within the replay budget (the batch with its
        connection and the read ahead): then half the budget divided by the replaying sessions."""
        return max(1, min(self.replay_bytes, self.replay_budget.limit // (2 * max(1, self.replaying))))

    def _watch_stalled_replays(self) -> None:
        """A replay read waits for the budget: watch (until nobody waits) for replaying sessions
        whose connection has not taken their batch within ``max_lag``; they are cut as too slow,
        giving back what they hold (a stalled reader must not keep every replay waiting)."""
        if self._stall_watch is None or self._stall_watch.done():
            self._stall_watch = asyncio.create_task(self._cut_stalled_replays(), name="replay-stall-watch")

    async def _cut_stalled_replays(self) -> None:
        while self.replay_budget.waiting and not self._closed:
            now = self.clock()
            for s in list(self._sessions):
                since = s.replay_stalled_since
                if (since is not None and now - since >= self.max_lag and self.replay_budget.waiting
                        and not s.too_slow.is_set()):
                    self.stats.replay_stalled += 1
                    s.stalled_replay()
            await self.sleep(self.max_lag / 4)

    @property
    def at_capacity(self) -> bool:
        return len(self._sessions) >= self.max_consumers

    @property
    def consumer_count(self) -> int:
        return len(self._sessions)

    @property
    def sessions(self) -> tuple[ConsumerSession, ...]:
        """The consumer sessions registered now (for monitoring: lag = ``latest_seq - last_seq``)."""
        return tuple(self._sessions)

    @property
    def latest_seq(self) -> int:
        """The last seq this broadcaster has fanned out (or started after)."""
        return self._last_seq or 0

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, session: ConsumerSession) -> None:
        """Start handing ``session`` live batches (its :meth:`~ConsumerSession.frame_batches` does this)."""
        self._sessions.add(session)
        self.stats.consumers += 1

    def unregister(self, session: ConsumerSession) -> None:
        self._sessions.discard(session)
        self.stats.consumers -= 1

    async def start(self, after_seq: int | None = None) -> None:
        """Position the bus subscription (default: at the store's latest seq) and start fanning
        out. Anything the bus no longer holds between the position and what it delivers is read
        from the store."""
        if after_seq is None:
            after_seq = await self.store.latest_seq() or 0
        self._last_seq = after_seq
        self._sub = self.bus.subscribe(after_seq=after_seq)
        self._task = asyncio.create_task(self._fan_out(), name="broadcast-fan-out")

    async def close(self) -> None:
        self._closed = True
        if self._stall_watch is not None:
            self._stall_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stall_watch
        if self._sub is not None:
            await self._sub.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, BusClosed):
                pass
        for s in list(self._sessions):
            s.wake()

    def session(self, cursor: int | None) -> ConsumerSession:
        return ConsumerSession(self, cursor)

    async def _fill_gap(self, upto: int | None) -> None:
        """Deliver from the store what the bus did not: ``last < seq < upto`` (``None``: everything
        stored), one bounded chunk at a time."""
        while True:
            last = self._last_seq or 0
            evs = await self.store.read_after(last, self.replay_batch)
            chunk = evs if upto is None else [e for e in evs if e.seq < upto]
            if chunk:
                self.deliver(chunk)
            if len(chunk) < len(evs) or len(evs) < self.replay_batch:
                return

    async def _fan_out(self) -> None:
        """Follow the bus until closed, never delivering past a hole.

        Seqs are consecutive (the sequencer numbers without gaps, and an event is in the store
        before it is published), so any seq missing from what the bus delivers — before the batch
        or inside it — is read from the store first: a publish that failed, an ingest that died
        between commit and publish, a Redis restart that lost entries, or a trim. While the bus
        cannot be read (e.g. Redis down) the store is followed instead (higher latency, no loss),
        and the bus is retried with backoff."""
        assert self._sub is not None
        backoff = Backoff(0.1, 5.0)
        while not self._closed:
            try:
                batch = await self._sub.next_batch()
                last = self._last_seq
                if last is not None and batch[-1].seq > last and (
                        batch[0].seq > last + 1 or batch[-1].seq - batch[0].seq != len(batch) - 1):
                    self.stats.bus_gaps_filled += 1
                    await self._fill_gap(batch[-1].seq + 1)
                self.deliver(batch)
                backoff.reset()
            except BusClosed:
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.bus_errors += 1
                log.exception("broadcast fan-out: bus read failed; following the store meanwhile")
                delay = backoff.next()
                try:
                    await self._fill_gap(None)  # whatever was stored since (the bus may have lost it)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.warning("broadcast fan-out: the store cannot be read either")
                await asyncio.sleep(delay)

    def deliver(self, batch: list[SequencedEvent]) -> None:
        """Hand a batch (ascending seq) to every session. Synchronous: never awaits."""
        last = self._last_seq
        if last is not None:
            batch = [e for e in batch if e.seq > last]
        if not batch:
            return
        self._last_seq = batch[-1].seq
        wire = WireBatch([e.frame for e in batch])  # framed once, on first use, for every consumer
        for s in self._sessions:
            s.offer(batch, wire)


SendFn = Callable[[bytes], Awaitable[None]]
SendManyFn = Callable[[list[bytes]], Awaitable[None]]
SendEventsFn = Callable[[list[SequencedEvent]], Awaitable[None]]
#: Sends a WebSocket ping after everything written so far; returns once the peer answered it.
ProbeFn = Callable[[], Awaitable[None]]


async def pump(
    session: ConsumerSession,
    send: SendFn,
    closed: Awaitable[object] | None = None,
    *,
    send_many: SendManyFn | None = None,
    send_events: SendEventsFn | None = None,
    probe: ProbeFn | None = None,
    send_final: SendFn | None = None,
    error_send_timeout: float = 2.0,
) -> None:
    """Drive one session over a transport: send every frame; stop at once when the peer goes
    away (``closed`` completes) or on ``ConsumerTooSlow`` (even if a send is stuck on a stalled
    peer). The caller closes the transport afterwards, unless ``send_final`` did.

    ``send_many(frames)``, when given, sends a list of frames in order (one transport write and
    one wait for backpressure per list); otherwise ``send`` is awaited per frame.
    ``send_events(events)``, when given, is handed the events themselves instead (see
    :meth:`ConsumerSession.event_batches`); ``send`` then only gets the ``ConsumerTooSlow`` frame.
    ``probe``, when given, lets the session measure its lag (:meth:`ConsumerSession.watch_lag`).
    ``send_final(frame)`` writes the ``ConsumerTooSlow`` frame behind whatever is unsent, without
    waiting for the peer, and starts closing the connection (a stalled peer is cut after the
    transport's close timeout); without it the error frame is tried with ``send`` for
    ``error_send_timeout`` seconds.
    """

    async def run() -> None:
        if send_events is not None:
            events = session.event_batches()
            try:
                async for evs in events:
                    await send_events(evs)
            finally:
                await events.aclose()
            return
        batches = session.frame_batches()
        try:
            async for batch in batches:
                if send_many is not None:
                    await send_many(batch)
                else:
                    for frame in batch:
                        await send(frame)
        finally:
            await batches.aclose()

    task = asyncio.create_task(run())
    slow = asyncio.create_task(session.too_slow.wait())
    gone = asyncio.ensure_future(closed) if closed is not None else None
    waiters = {task, slow} | ({gone} if gone is not None else set())
    if probe is not None:
        waiters.add(asyncio.create_task(session.watch_lag(probe)))
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        too_slow = session.too_slow.is_set()
        if task in done and not too_slow:
            task.result()
            return
        if not task.done():
            task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        if too_slow and session.close_frame is not None and (gone is None or not gone.done()):
            try:
                if send_final is not None:
                    await send_final(session.close_frame)
                else:
                    await asyncio.wait_for(send(session.close_frame), error_send_timeout)
            except Exception:  # stalled or already gone: closing is all that is left
                pass
    finally:
        for w in waiters:
            if not w.done():
                w.cancel()
