"""Slowness by lag behind live: a live consumer that stops reading is told ``ConsumerTooSlow`` within
``max_lag`` at any event rate — here a handful of tiny events, far below every queue limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from firehose.broadcast import Broadcaster, ConsumerSession
from firehose.frames import decode_frame
from firehose.state import SequencedEvent
from tests.waiting import until

from .conftest import Ingest
from .servers import serve, ws_url

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["websockets", "asgi-batch"])
async def test_consumer_that_stops_reading_is_told_too_slow_at_a_low_rate(ingest: Ingest, transport: str) -> None:
    b = Broadcaster(ingest.store, ingest.bus, max_lag=1.0)
    await b.start()
    try:
        async with serve(b, transport) as hp:
            healthy = await connect(ws_url(hp), max_size=None)
            stalled = await connect(ws_url(hp), max_size=None)
            await until(lambda: b.consumer_count == 2, "both consumers registered")
            await ingest.add(1)
            assert decode_frame(await stalled.recv()).body["seq"] == 1  # live, and reading
            assert decode_frame(await healthy.recv()).body["seq"] == 1
            stalled.transport.pause_reading()  # stops reading: as a consumer stuck in its own work
            await ingest.add(3, batch=1)  # three tiny events: no queue comes near a limit
            for seq in (2, 3, 4):
                assert decode_frame(await healthy.recv()).body["seq"] == seq
            await until(lambda: b.stats.lagged == 1, "the lag probe's verdict")
            assert b.stats.too_slow == 1
            stalled.transport.resume_reading()
            got = []
            with pytest.raises(ConnectionClosed):
                while True:
                    f = decode_frame(await stalled.recv())
                    got.append(("error", f.error) if f.is_error else f.body["seq"])
            assert got == [2, 3, 4, ("error", "ConsumerTooSlow")]  # everything sent, then the error
            # the healthy consumer is untouched and still live
            await until(lambda: b.consumer_count == 1, "the stalled consumer gone")
            await ingest.add(1)
            assert decode_frame(await healthy.recv()).body["seq"] == 5
            assert b.stats.lagged == 1
            await healthy.close()
    finally:
        await b.close()


@pytest.mark.parametrize("transport", ["websockets", "asgi-batch"])
async def test_replaying_consumer_is_not_probed(ingest: Ingest, transport: str) -> None:
    """A consumer catching up from the past is never cut for lag, however long it pauses: only
    live writes are probed. The pause outlasts ``max_lag`` provably: it spans a live consumer's
    whole stall-to-cut."""
    await ingest.add(300, payload=b"r" * 32768)  # ~10 MB: more than the socket buffers hold
    b = Broadcaster(ingest.store, ingest.bus, max_lag=0.5, replay_batch=10)
    await b.start()
    try:
        async with serve(b, transport) as hp:
            replaying = await connect(ws_url(hp, cursor=0), max_size=None, max_queue=1)
            replaying.transport.pause_reading()
            live = await connect(ws_url(hp), max_size=None)
            await until(lambda: b.consumer_count == 2, "both registered")
            live.transport.pause_reading()
            await ingest.add(2, batch=1)
            await until(lambda: b.stats.lagged == 1, "the live consumer cut for lag")
            replaying.transport.resume_reading()
            seqs = [decode_frame(await replaying.recv()).body["seq"] for _ in range(302)]
            assert seqs == list(range(1, 303))
            await ingest.add(1)  # the marker: the replayed consumer is live now, and still connected
            assert decode_frame(await replaying.recv()).body["seq"] == 303
            assert b.stats.lagged == 1 and b.stats.too_slow == 1
            await replaying.close()
            live.transport.resume_reading()  # lets it read the error and the close
            await live.close()
    finally:
        await b.close()


async def _live_session(b: Broadcaster) -> tuple[ConsumerSession, AsyncGenerator[list[SequencedEvent], None],
                                                 asyncio.Future[list[SequencedEvent]]]:
    """A live session of the (not started) broadcaster ``b``, registered: the session, its batches,
    and the future of its first batch (a live session registers when its batches are first asked)."""
    session = b.session(None)
    batches = session.event_batches()
    first = asyncio.ensure_future(anext(batches))
    await until(lambda: b.consumer_count == 1, "the session registered")
    return session, batches, first


async def test_every_later_write_is_probed_again(ingest: Ingest) -> None:
    """``watch_lag`` probe by probe: after a probe is answered, the next live write gets a probe of
    its own; a consumer that stalls only then (its first probe answered) is still cut for lag."""
    b = Broadcaster(ingest.store, ingest.bus, max_lag=0.4, clock=lambda: 100.0)  # not started
    session, batches, first = await _live_session(b)
    probes: list[asyncio.Event] = []

    async def probe() -> None:
        answered = asyncio.Event()
        probes.append(answered)
        await answered.wait()

    ev = _event
    watcher = asyncio.create_task(session.watch_lag(probe))
    try:
        b.deliver([ev(1)])
        assert [e.seq for e in await first] == [1]
        await until(lambda: len(probes) == 1, "the first write probed")
        probes[0].set()  # the consumer read it
        b.deliver([ev(2)])
        assert [e.seq for e in await anext(batches)] == [2]
        await until(lambda: len(probes) == 2, "the later write probed as well")
        await asyncio.wait_for(session.too_slow.wait(), 30)  # this probe is never answered
        assert b.stats.lagged == 1 and session.close_frame is not None
        await asyncio.wait_for(watcher, 30)  # it ends with its verdict
    finally:
        watcher.cancel()
        await batches.aclose()


class _PacedClock:
    """A clock for ``watch_lag`` that moves only when the watcher sleeps between probes, and only
    once the test lets it: ``sleeps`` holds each pause asked for."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.go = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await self.go.wait()
        self.go.clear()
        self.now += seconds


def _event(seq: int) -> SequencedEvent:
    return SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"frame %d" % seq)


async def test_a_consumer_answering_every_probe_at_once_is_never_cut(ingest: Ingest) -> None:
    """Probes are paced (at most one per ``max_lag / 4``), but a write made while the watcher waits
    keeps its own deadline: its probe is sent well within ``max_lag`` of it, so a consumer that
    answers at once is never cut, wherever its writes fall relative to the pacing."""
    t = _PacedClock()
    b = Broadcaster(ingest.store, ingest.bus, max_lag=0.4, clock=t.clock, sleep=t.sleep)  # not started
    session, batches, first = await _live_session(b)
    probes: list[float] = []

    async def probe() -> None:  # answered at once
        probes.append(t.now)

    watcher = asyncio.create_task(session.watch_lag(probe))
    try:
        b.deliver([_event(1)])
        assert [e.seq for e in await first] == [1]
        await until(lambda: len(t.sleeps) == 1, "the first probe answered, the watcher pacing")
        t.now = 0.01  # a write just after that probe
        b.deliver([_event(2)])
        assert [e.seq for e in await anext(batches)] == [2]
        t.go.set()  # the pause ends
        await until(lambda: len(t.sleeps) == 2 or session.too_slow.is_set(), "the second write's probe")
        assert not session.too_slow.is_set() and b.stats.lagged == 0
        assert probes == [0.0, 0.01 + t.sleeps[0]] and probes[1] - 0.01 < 0.4
    finally:
        watcher.cancel()
        await batches.aclose()


async def test_a_probe_sent_past_its_deadline_cuts_at_once(ingest: Ingest) -> None:
    """When the watcher gets to a write only after ``max_lag`` has already passed (the loop was busy),
    the consumer is cut at once — not given more time to answer, however quickly it would."""
    t = _PacedClock()
    b = Broadcaster(ingest.store, ingest.bus, max_lag=0.4, clock=t.clock, sleep=t.sleep)  # not started
    session, batches, first = await _live_session(b)

    async def probe() -> None:  # answered within a turn of the loop
        await asyncio.sleep(0)

    b.deliver([_event(1)])
    assert [e.seq for e in await first] == [1]  # written at 0.0
    t.now = 1.0  # the watcher starts only now, 1 s after the write
    watcher = asyncio.create_task(session.watch_lag(probe))
    try:
        await until(lambda: session.too_slow.is_set() or bool(t.sleeps), "the probe's verdict")
        assert session.too_slow.is_set() and b.stats.lagged == 1
    finally:
        watcher.cancel()
        await batches.aclose()


async def test_each_lagging_session_is_counted_and_told_its_lag(ingest: Ingest) -> None:
    """Two live sessions whose probes are never answered: both cut for lag, each counted (in
    ``lagged`` and ``too_slow``), each told the ``max_lag`` it exceeded."""
    b = Broadcaster(ingest.store, ingest.bus, max_lag=0.25, clock=lambda: 100.0)  # not started

    async def unanswered() -> None:
        await asyncio.Event().wait()

    sessions = [b.session(None), b.session(None)]
    batches = [s.event_batches() for s in sessions]
    firsts = [asyncio.ensure_future(anext(each)) for each in batches]
    await until(lambda: b.consumer_count == 2, "both sessions registered")
    watchers = [asyncio.create_task(s.watch_lag(unanswered)) for s in sessions]
    try:
        b.deliver([_event(1)])
        for first in firsts:
            assert [e.seq for e in await asyncio.wait_for(first, 10)] == [1]
        await asyncio.wait_for(asyncio.gather(*watchers), 30)  # each ends with its verdict
        assert b.stats.lagged == 2 and b.stats.too_slow == 2
        for s in sessions:
            assert s.close_frame is not None
            frame = decode_frame(s.close_frame)
            assert frame.is_error and frame.body.get("message") == "more than 0.25 s behind live"
    finally:
        for w in watchers:
            w.cancel()
        for each in batches:
            await each.aclose()
