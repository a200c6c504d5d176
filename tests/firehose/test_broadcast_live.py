"""The broadcaster's live path, driven through its public methods (``deliver``, sessions'
``event_batches``, a ``DirectWriter``) and its fan-out over a real in-process bus and store:
queue bounds, the too-slow cut and what it sends, replay overflows counted once per episode,
close with events still queued, and holes in what the bus delivers filled from the store."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest

from backfill.store import Store
from firehose.broadcast import (
    CONSUMER_TOO_SLOW,
    ERROR_KIND,
    FUTURE_CURSOR,
    Broadcaster,
    ConsumerSession,
    pump,
)
from firehose.bus import InProcessBus, Subscription
from firehose.frames import decode_frame
from firehose.serve_wire import WireBatch
from firehose.state import SequencedEvent
from tests.waiting import until

from .conftest import Ingest, commit_frame

pytestmark = pytest.mark.timeout(60)


def ev(seq: int, size: int = 10) -> SequencedEvent:
    return SequencedEvent(seq, "did:plc:live", "#commit", 0.0, b"x" * size)


async def registered(b: Broadcaster, session: ConsumerSession) -> tuple[AsyncGenerator[list[SequencedEvent], None],
                                                                         asyncio.Future[list[SequencedEvent]]]:
    """Start ``session``'s batches; returns them and its first ``anext``, once it is registered."""
    before = b.consumer_count
    batches = session.event_batches()
    first = asyncio.ensure_future(anext(batches))
    await until(lambda: b.consumer_count == before + 1, "the session registered")
    return batches, first


async def read_up_to(batches: AsyncGenerator[list[SequencedEvent], None], got: list[int], n: int) -> None:
    """Append the seqs of the session's next batches to ``got`` until it holds ``n`` (10 s a batch)."""
    while len(got) < n:
        got += [e.seq for e in await asyncio.wait_for(anext(batches), 10)]


async def ended(batches: AsyncGenerator[list[SequencedEvent], None], pending: asyncio.Future[list[SequencedEvent]]
                | None = None) -> None:
    """The session's batches end (no further list)."""
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending if pending is not None else anext(batches), 10)


def too_slow_message(session: ConsumerSession) -> str:
    assert session.close_frame is not None
    frame = decode_frame(session.close_frame)
    assert frame.is_error and frame.error == CONSUMER_TOO_SLOW
    return str(frame.body.get("message"))


async def test_the_live_queue_holds_live_queue_max_frames_and_not_one_more(ingest: Ingest) -> None:
    """A live session may have exactly ``live_queue_max`` frames queued; one more cuts it, once:
    counted once, told why, its queue dropped and its batches ended."""
    b = Broadcaster(ingest.store, ingest.bus, live_queue_max=3)  # not started: the test is the fan-out
    session = b.session(None)
    batches, first = await registered(b, session)
    assert b.stats.consumers == 1
    b.deliver([ev(1), ev(2), ev(3)])
    assert not session.too_slow.is_set()
    assert [e.seq for e in await first] == [1, 2, 3]
    b.deliver([ev(4), ev(5), ev(6)])
    assert not session.too_slow.is_set()
    b.deliver([ev(7)])
    assert session.too_slow.is_set() and b.stats.too_slow == 1
    assert too_slow_message(session) == "live queue overflowed"
    b.deliver([ev(8)])  # a cut session takes nothing more and is not counted again
    assert b.stats.too_slow == 1
    await ended(batches)
    assert b.consumer_count == 0 and b.stats.consumers == 0


async def test_by_default_a_live_queue_holds_10_000_events(ingest: Ingest) -> None:
    """The documented default: a live session not yet written to directly may have 10,000 events
    queued; one more cuts it."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    b.deliver([ev(1)])
    assert [e.seq for e in await first] == [1]
    b.deliver([ev(seq) for seq in range(2, 10_002)])
    assert not session.too_slow.is_set()
    b.deliver([ev(10_002)])
    assert session.too_slow.is_set() and too_slow_message(session) == "live queue overflowed"
    await ended(batches)


async def test_by_default_a_broadcaster_takes_10_000_consumers(ingest: Ingest) -> None:
    """With its defaults a broadcaster is at capacity with 10,000 sessions registered, not before."""
    b = Broadcaster(ingest.store, ingest.bus)
    sessions = [b.session(None) for _ in range(10_000)]
    for s in sessions[:-1]:
        b.register(s)
    assert not b.at_capacity
    b.register(sessions[-1])
    assert b.at_capacity


async def test_max_lag_must_be_positive(ingest: Ingest) -> None:
    """A broadcaster refuses a ``max_lag`` of zero, and takes any positive one (under a second too)."""
    with pytest.raises(ValueError, match="^max_lag must be positive$"):
        Broadcaster(ingest.store, ingest.bus, max_lag=0)
    assert Broadcaster(ingest.store, ingest.bus, max_lag=0.5).max_lag == 0.5


async def test_the_live_queue_holds_live_queue_bytes_and_not_one_more(ingest: Ingest) -> None:
    """A live session may have exactly ``live_queue_bytes`` of frames queued; one byte more cuts it."""
    b = Broadcaster(ingest.store, ingest.bus, live_queue_bytes=30)
    session = b.session(None)
    batches, first = await registered(b, session)
    b.deliver([ev(1), ev(2), ev(3)])  # 30 bytes
    assert not session.too_slow.is_set()
    b.deliver([ev(4, 1)])
    assert session.too_slow.is_set() and b.stats.too_slow == 1
    await ended(batches, first)


async def test_a_session_waiting_for_events_ends_when_cut(ingest: Ingest) -> None:
    """A session waiting on an empty queue ends when one batch overflows it (the overflow clears
    what was queued: nothing of that batch is handed on); two sessions cut count two."""
    b = Broadcaster(ingest.store, ingest.bus, live_queue_max=2)
    one, two = b.session(None), b.session(None)
    batches_one, first_one = await registered(b, one)
    batches_two, first_two = await registered(b, two)
    b.deliver([ev(1), ev(2), ev(3)])
    assert one.too_slow.is_set() and two.too_slow.is_set()
    assert b.stats.too_slow == 2 and b.stats.consumers == 2
    await ended(batches_one, first_one)
    await ended(batches_two, first_two)
    assert b.stats.consumers == 0


class RecordingWriter:
    """A ``DirectWriter`` that records what it is handed and refuses once ``full`` is set."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []
        self.full = False
        self.wrote = asyncio.Event()

    def write(self, batch: WireBatch) -> bool:
        if self.full:
            return False
        self.batches.append(list(batch.frames))
        self.wrote.set()
        return True


async def test_a_direct_writer_refusing_a_batch_cuts_the_session_and_gets_nothing_more(ingest: Ingest) -> None:
    """A session with a ``DirectWriter`` and nothing queued is written by the fan-out itself; a
    refused write cuts it (ConsumerTooSlow, counted once) and nothing is written to it afterwards,
    queued or direct."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    writer = RecordingWriter()
    session.direct_writer = writer
    batches, waiting = await registered(b, session)  # its queue is empty: direct from the start
    b.deliver([ev(1), ev(2)])
    assert writer.batches == [[ev(1).frame, ev(2).frame]] and session.sent == 2 and session.last_seq == 2
    writer.full = True
    b.deliver([ev(3)])
    assert session.too_slow.is_set() and b.stats.too_slow == 1
    assert too_slow_message(session) == "live queue overflowed"
    writer.full = False
    b.deliver([ev(4)])
    assert writer.batches == [[ev(1).frame, ev(2).frame]] and session.sent == 2
    await ended(batches, waiting)


async def test_a_direct_session_skips_what_it_sent_and_counts_what_it_writes(ingest: Ingest) -> None:
    """A direct-mode session handed a batch overlapping what it sent writes only the events past
    its last seq (a batch starting at it included), nothing for a batch wholly sent; ``sent``,
    ``bytes_sent`` and ``last_seq`` add up over the writes."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    writer = RecordingWriter()
    session.direct_writer = writer
    batches, waiting = await registered(b, session)
    b.deliver([ev(1), ev(2, 20)])
    shared = WireBatch([ev(2, 20).frame, ev(3, 30).frame])
    session.offer([ev(2, 20), ev(3, 30)], shared)  # starts at the last seq sent
    session.offer([ev(1), ev(3, 30)])  # wholly sent already
    assert writer.batches == [[ev(1).frame, ev(2, 20).frame], [ev(3, 30).frame]]
    assert (session.sent, session.bytes_sent, session.last_seq) == (3, 60, 3)
    await b.close()
    await ended(batches, waiting)


async def test_a_queued_session_counts_what_it_hands_on(ingest: Ingest) -> None:
    """Events handed on from the live queue: ``sent``, ``bytes_sent`` and ``last_seq`` add up
    over the batches, and queued events at or below the last seq sent are skipped."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    b.deliver([ev(1), ev(2, 20)])
    assert [e.seq for e in await first] == [1, 2]
    assert (session.sent, session.bytes_sent, session.last_seq) == (2, 30, 2)
    session.offer([ev(2, 20), ev(3, 30)])
    assert [e.seq for e in await asyncio.wait_for(anext(batches), 10)] == [3]
    assert (session.sent, session.bytes_sent, session.last_seq) == (3, 60, 3)
    session.offer([ev(4, 40)])
    assert [e.seq for e in await asyncio.wait_for(anext(batches), 10)] == [4]
    assert (session.sent, session.bytes_sent, session.last_seq) == (4, 100, 4)
    await b.close()
    await ended(batches)


async def test_close_hands_on_what_is_queued_then_ends(ingest: Ingest) -> None:
    """A broadcaster closing with events queued for a session: the session still yields them,
    then ends."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    b.deliver([ev(1)])
    assert [e.seq for e in await first] == [1]
    b.deliver([ev(2), ev(3)])
    await b.close()
    assert [e.seq for e in await asyncio.wait_for(anext(batches), 10)] == [2, 3]
    await ended(batches)


async def test_a_future_cursor_ends_with_an_error_event(ingest: Ingest) -> None:
    """``event_batches`` ends a session whose cursor is ahead with one event of kind
    :data:`ERROR_KIND` carrying the ``FutureCursor`` frame."""
    await ingest.add(3)
    b = Broadcaster(ingest.store, ingest.bus)
    batches = b.session(9).event_batches()
    [error] = await asyncio.wait_for(anext(batches), 10)
    assert error.kind == ERROR_KIND and error.seq == 0
    frame = decode_frame(error.frame)
    assert frame.is_error and frame.error == FUTURE_CURSOR
    await ended(batches)
    assert b.stats.future_cursor == 1


async def test_a_replay_overflow_is_counted_once_per_session(ingest: Ingest) -> None:
    """Live events overflowing a replaying session's queue are dropped (the store has them) and
    counted once per episode, however many more are dropped: two sessions, two overflows."""
    await ingest.add(4)
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=2, live_queue_max=2)
    one, two = b.session(0), b.session(0)
    batches_one, first_one = await registered(b, one)
    batches_two, first_two = await registered(b, two)
    assert [e.seq for e in await first_one] == [1, 2]  # each now holds its first replay batch
    assert [e.seq for e in await first_two] == [1, 2]
    b.deliver([ev(5), ev(6), ev(7)])
    assert b.stats.replay_overflows == 2
    b.deliver([ev(8), ev(9), ev(10)])
    assert b.stats.replay_overflows == 2
    assert not one.too_slow.is_set() and not two.too_slow.is_set()
    await batches_one.aclose()
    await batches_two.aclose()


class LossyBus(InProcessBus):
    """An in-process bus that loses the publishes of the chosen seqs (a failed publish, an ingest
    that died between commit and publish)."""

    def __init__(self, lose: set[int]) -> None:
        super().__init__()
        self.lose = lose

    async def publish(self, events: list[SequencedEvent]) -> None:
        kept = [e for e in events if e.seq not in self.lose]
        if kept:
            await super().publish(kept)


class ReadLog:
    """The real store, read through, recording each ``read_after`` as ``(after, limit)`` (what a
    gap fill or a time cursor costs)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.reads: list[tuple[int, int]] = []

    async def read_after(self, seq: int, limit: int = 1000) -> list[SequencedEvent]:
        self.reads.append((seq, limit))
        return await self.store.read_after(seq, limit)

    async def oldest_seq(self) -> int | None:
        return await self.store.oldest_seq()

    async def latest_seq(self) -> int:
        return await self.store.latest_seq()


@pytest.mark.parametrize(("lost", "replay_batch"), [
    (set(range(1, 9)), 4),  # a hole of two whole store reads before a batch
    (set(range(1, 10)), 4),  # a hole of two reads and a bit
    ({3, 4, 5, 6, 7}, 2),  # inside a batch, longer than a read
])
async def test_a_hole_longer_than_a_store_read_is_filled_in_order(ingest: Ingest, lost: set[int],
                                                                  replay_batch: int) -> None:
    """What the bus never delivered is read from the store in chunks of ``replay_batch`` (a
    bounded read each) until the hole is closed, and handed on in order before anything after it,
    as one filled gap."""
    bus = LossyBus(lost)
    ingest.bus = bus
    store = ReadLog(ingest.store)
    b = Broadcaster(store, bus, replay_batch=replay_batch)
    session = b.session(None)
    batches, first = await registered(b, session)
    await b.start(after_seq=0)
    try:
        await ingest.add(12, batch=12)
        got = [e.seq for e in await asyncio.wait_for(first, 10)]
        await read_up_to(batches, got, 12)
        assert got == list(range(1, 13))
        assert b.stats.bus_gaps_filled == 1 and b.stats.bus_errors == 0
        assert store.reads and {limit for _, limit in store.reads} == {replay_batch}
        if lost == set(range(1, 9)):  # whole reads up to the batch, one more that comes back short
            assert store.reads == [(0, 4), (4, 4), (8, 4), (12, 4)]
    finally:
        await batches.aclose()
        await b.close()


async def test_each_hole_is_counted(ingest: Ingest) -> None:
    """Two bus batches, each with a hole inside: two gaps filled, everything in order."""
    bus = LossyBus({2, 9})
    ingest.bus = bus
    b = Broadcaster(ingest.store, bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    await b.start(after_seq=0)
    try:
        await ingest.add(6, batch=6)
        got = [e.seq for e in await asyncio.wait_for(first, 10)]
        await read_up_to(batches, got, 6)
        assert b.stats.bus_gaps_filled == 1
        await ingest.add(6, batch=6)
        await read_up_to(batches, got, 12)
        assert got == list(range(1, 13)) and b.stats.bus_gaps_filled == 2
    finally:
        await batches.aclose()
        await b.close()


class FlakyBus(InProcessBus):
    """An in-process bus whose subscriptions fail their first ``failures`` reads (Redis down for a
    moment), losing nothing."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def subscribe(self, after_seq: int | None = None) -> Subscription:
        inner = super().subscribe(after_seq=after_seq)
        bus = self

        class Flaky:
            async def next_batch(self) -> list[SequencedEvent]:
                if bus.failures:
                    bus.failures -= 1
                    raise ConnectionError("bus read failed")
                return await inner.next_batch()

            async def close(self) -> None:
                await inner.close()

        return Flaky()  # type: ignore[return-value]


async def test_a_failed_bus_read_is_counted_and_the_fan_out_goes_on(ingest: Ingest) -> None:
    """One failed bus read: counted once, what was stored meanwhile comes from the store, and the
    fan-out then follows the bus again."""
    await ingest.add(3)  # stored before the fan-out starts
    bus = FlakyBus(failures=1)
    ingest.bus = bus
    b = Broadcaster(ingest.store, bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    await b.start(after_seq=0)
    try:
        got = [e.seq for e in await asyncio.wait_for(first, 10)]
        assert got == [1, 2, 3] and b.stats.bus_errors == 1
        await ingest.add(2)
        await read_up_to(batches, got, 5)
        assert got == [1, 2, 3, 4, 5]
        assert b.stats.bus_errors == 1 and b.stats.bus_gaps_filled == 0
    finally:
        with contextlib.suppress(Exception):
            await batches.aclose()
        await b.close()


async def test_live_frames_reach_a_session_as_stored(ingest: Ingest) -> None:
    """Started without a position, the fan-out follows from the store's latest seq; it hands on
    the stored frames themselves."""
    await ingest.add(3)
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    batches, first = await registered(b, session)
    await b.start()
    assert b.latest_seq == 3
    try:
        await ingest.add(2, batch=2)
        assert [e.frame for e in await asyncio.wait_for(first, 10)] == [commit_frame(4), commit_frame(5)]
    finally:
        await batches.aclose()
        await b.close()


class Peer:
    """What ``pump`` writes to: the frames (or events) it is sent, optionally a send that fails or
    never returns for the ``ConsumerTooSlow`` frame."""

    def __init__(self, *, fail: bool = False, stall_error: bool = False) -> None:
        self.sent: list[bytes | None] = []
        self.events: list[SequencedEvent] = []
        self.fail = fail
        self.stall_error = stall_error

    async def send(self, frame: bytes) -> None:
        if self.fail:
            raise ConnectionError("the peer reset the connection")
        self.sent.append(frame)
        if self.stall_error and frame is not None and decode_frame(frame).is_error:
            await asyncio.Event().wait()

    async def send_events(self, events: list[SequencedEvent]) -> None:
        self.events += events


async def _pumping(ingest: Ingest) -> tuple[Broadcaster, Peer, asyncio.Future[None], asyncio.Task[None]]:
    """A live session of a new broadcaster pumped frame by frame to a recording ``Peer`` until
    ``closed`` completes; returned once the session is registered."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    peer = Peer()
    closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pumping = asyncio.create_task(pump(session, peer.send, closed))
    await until(lambda: b.consumer_count == 1, "the session registered")
    return b, peer, closed, pumping


async def test_pump_sends_each_frame_ends_with_the_session_and_lets_go_of_closed(ingest: Ingest) -> None:
    """Frame by frame (no ``send_many``), every live frame is sent; when the session's batches end
    (the broadcaster closes) ``pump`` returns and cancels what it was still waiting on."""
    b, peer, closed, pumping = await _pumping(ingest)
    b.deliver([ev(1), ev(2, 20)])
    await until(lambda: len(peer.sent) == 2, "both frames sent")
    await b.close()
    await asyncio.wait_for(pumping, 10)
    assert peer.sent == [ev(1).frame, ev(2, 20).frame] and closed.cancelled()


async def test_pump_hands_events_to_send_events(ingest: Ingest) -> None:
    """With ``send_events``, the events themselves are handed on (``send`` is not used)."""
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    peer = Peer(fail=True)  # ``send`` would raise
    pumping = asyncio.create_task(pump(session, peer.send, send_events=peer.send_events))
    await until(lambda: b.consumer_count == 1, "the session registered")
    b.deliver([ev(1), ev(2)])
    await until(lambda: len(peer.events) == 2, "both events handed on")
    await b.close()
    await asyncio.wait_for(pumping, 10)
    assert [e.seq for e in peer.events] == [1, 2]


async def test_pump_raises_what_a_send_raised(ingest: Ingest) -> None:
    b = Broadcaster(ingest.store, ingest.bus)
    session = b.session(None)
    closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pumping = asyncio.create_task(pump(session, Peer(fail=True).send, closed))
    await until(lambda: b.consumer_count == 1, "the session registered")
    b.deliver([ev(1)])
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(pumping, 10)
    await b.close()


async def test_pump_returns_quietly_when_the_peer_goes(ingest: Ingest) -> None:
    """The peer going away (``closed`` completes, or the lag probe fails) ends ``pump`` without an
    error and without sending anything more."""
    b, peer, closed, pumping = await _pumping(ingest)
    closed.set_result(None)
    await asyncio.wait_for(pumping, 10)
    assert peer.sent == []

    async def gone() -> None:
        raise ConnectionError("the peer is gone")

    probed = b.session(None)
    peer = Peer()
    pumping = asyncio.create_task(pump(probed, peer.send, asyncio.get_running_loop().create_future(), probe=gone))
    await until(lambda: b.consumer_count == 1, "the probed session registered")  # the first one is gone
    b.deliver([ev(3)])
    await asyncio.wait_for(pumping, 10)
    assert peer.sent == [ev(3).frame] and not probed.too_slow.is_set()
    await b.close()


async def test_pump_sends_the_too_slow_frame_unless_the_peer_is_gone(ingest: Ingest) -> None:
    """A cut session's ``ConsumerTooSlow`` frame is sent with ``send`` (``closed`` not given); a
    send of it that never returns is given up after ``error_send_timeout``; a cut session whose
    peer is gone already is sent nothing."""
    b = Broadcaster(ingest.store, ingest.bus, live_queue_max=1)
    session = b.session(None)
    peer = Peer()
    session.stalled_replay()
    await asyncio.wait_for(pump(session, peer.send), 10)
    assert peer.sent == [session.close_frame] and session.close_frame is not None

    stalled = b.session(None)
    peer = Peer(stall_error=True)
    stalled.stalled_replay()
    await asyncio.wait_for(pump(stalled, peer.send, error_send_timeout=0.01), 10)
    assert peer.sent == [stalled.close_frame]

    gone_already = b.session(None)
    peer = Peer()
    gone_already.stalled_replay()
    closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    closed.set_result(None)
    await asyncio.wait_for(pump(gone_already, peer.send, closed), 10)
    assert peer.sent == []
