"""Broadcaster over real WebSocket connections on 127.0.0.1, backed by the real stores."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from firehose.broadcast import Broadcaster
from firehose.frames import Frame, decode_frame
from firehose.jetstream import JetstreamConverter, ZstdCodec, parse_options, select
from tests.waiting import until

from .conftest import Ingest
from .servers import serve, ws_url

pytestmark = pytest.mark.timeout(60)


async def collect(url: str, *, until_seq: int | None = None, count: int | None = None, delay: float = 0.0,
                  rcvbuf: int | None = None):
    """Read frames until a seq >= until_seq, ``count`` frames, an error frame or close. ``rcvbuf``:
    the socket's receive buffer (small: the kernel cannot absorb what a slow reader leaves)."""
    out: list = []
    sock = None
    if rcvbuf is not None:
        host, port = urlsplit(url).netloc.split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect((host, int(port)))
    async with connect(url, max_size=None, sock=sock) as ws:
        try:
            while True:
                f = decode_frame(await ws.recv())
                if f.is_error:
                    out.append(("error", f.error))
                    return out
                if f.t == "#info":
                    out.append(("info", f.body["name"]))
                    continue
                out.append(f.body["seq"])
                if until_seq is not None and f.body["seq"] >= until_seq:
                    return out
                if count is not None and len(out) >= count:
                    return out
                if delay:
                    await asyncio.sleep(delay)
        except ConnectionClosed:
            out.append(("closed",))
            return out


async def first_frame(url: str) -> Frame:
    """The first frame a consumer connecting to ``url`` receives."""
    async with connect(url, max_size=None) as ws:
        return decode_frame(await ws.recv())


@pytest.fixture
async def broadcaster(ingest: Ingest):
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=25, live_queue_max=500)
    yield b
    await b.close()


@pytest.mark.parametrize("transport", ["websockets", "asgi", "asgi-batch"])
async def test_cursor_rules(ingest: Ingest, broadcaster: Broadcaster, transport: str) -> None:
    old = time.time() - 3600
    await ingest.add(20, when=old)
    await ingest.add(30)
    assert await ingest.store.trim(older_than_seconds=60) == 20  # window is now seq 21..50
    await broadcaster.start()
    async with serve(broadcaster, transport) as hp:
        # cursor 0: the whole window from the oldest
        assert await collect(ws_url(hp, 0), until_seq=50) == list(range(21, 51))
        # in window: seq > cursor (the cursor is the last seq the consumer processed)
        assert await collect(ws_url(hp, 40), until_seq=50) == list(range(41, 51))
        assert await collect(ws_url(hp, 21), until_seq=50) == list(range(22, 51))
        # one before the oldest: nothing the consumer has not seen was trimmed, no #info
        assert await collect(ws_url(hp, 20), until_seq=50) == list(range(21, 51))
        # older than the window: #info OutdatedCursor, then the whole window
        assert await collect(ws_url(hp, 5), until_seq=50) == [("info", "OutdatedCursor"), *range(21, 51)]
        info = await first_frame(ws_url(hp, 19))
        assert (info.t, info.body) == ("#info", {"name": "OutdatedCursor",
                                                 "message": "cursor is older than the backfill window"})
        assert broadcaster.stats.outdated_cursor == 2
        # future cursor (beyond latest): error frame then close
        assert await collect(ws_url(hp, 51)) == [("error", "FutureCursor")]
        error = await first_frame(ws_url(hp, 1000))
        assert error.is_error and error.body == {"error": "FutureCursor", "message": "cursor is ahead of the stream"}
        assert broadcaster.stats.future_cursor == 2
        # no cursor: live only; cursor = latest (the consumer saw everything): waits for the next
        live = asyncio.create_task(collect(ws_url(hp), until_seq=55))
        following = asyncio.create_task(collect(ws_url(hp, 50), until_seq=55))
        await until(lambda: broadcaster.consumer_count == 2)
        await ingest.add(5)
        assert await live == [51, 52, 53, 54, 55]
        assert await following == [51, 52, 53, 54, 55]
        assert (broadcaster.stats.future_cursor, broadcaster.stats.outdated_cursor) == (2, 2)
        # in-window cursor followed by live events
        task = asyncio.create_task(collect(ws_url(hp, 49), until_seq=60))
        await until(lambda: broadcaster.consumer_count == 1)
        await ingest.add(5)
        assert await task == list(range(50, 61))


async def test_cursor_zero_on_an_empty_stream_waits_for_the_first_event(ingest: Ingest, broadcaster: Broadcaster) -> None:
    """Nothing sequenced yet: cursor 0 is "from the first event on" (no ``OutdatedCursor``, no
    ``FutureCursor``); cursor 1 is ahead of the stream."""
    await broadcaster.start()
    async with serve(broadcaster, "websockets") as hp:
        assert await collect(ws_url(hp, 1)) == [("error", "FutureCursor")]
        first = asyncio.create_task(collect(ws_url(hp, 0), until_seq=3))
        await until(lambda: broadcaster.consumer_count == 1)
        await ingest.add(3)
        assert await first == [1, 2, 3]
        assert broadcaster.stats.outdated_cursor == 0


async def test_handoff_under_concurrent_ingest(ingest: Ingest, broadcaster: Broadcaster) -> None:
    await ingest.add(200)
    await broadcaster.start()
    target = 200 + 600
    async with serve(broadcaster, "websockets") as hp:
        writer = asyncio.create_task(ingest.add(600, batch=7))
        readers = []
        for cursor in (0, 1, 100, 150, 200):
            readers.append((cursor, asyncio.create_task(collect(ws_url(hp, cursor), until_seq=target))))
            await asyncio.sleep(0.02)
        await writer
        for cursor, task in readers:
            got = await task
            assert got == list(range(cursor + 1, target + 1)), f"cursor {cursor}: gap or duplicate"


class RecordingStore:
    """The real store, recording every ``read_after`` as ``(after, limit)``; pins a consumer in
    its replay for as long as a test needs (no timing assumptions). ``hold_every``: each read
    waits for :attr:`gate` before it is made. ``hold``: the read numbered so (1-based) is made at
    once and answered only when :attr:`gate` is set, with what the store held when it was asked
    (:attr:`held` is set meanwhile). ``fail``: the read numbered so raises."""

    def __init__(self, store, *, hold_every: bool = False, hold: int | None = None,
                 fail: int | None = None) -> None:
        self._store = store
        self.reads: list[tuple[int, int]] = []
        self.hold_every, self.hold, self.fail = hold_every, hold, fail
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def read_after(self, seq: int, limit: int = 1000):
        self.reads.append((seq, limit))
        n = len(self.reads)
        if self.hold_every:
            await self.gate.wait()
        if n == self.fail:
            raise ConnectionError("the store went away")
        rows = await self._store.read_after(seq, limit)
        if n == self.hold:
            self.held.set()
            await self.gate.wait()
        return rows


async def test_slow_catching_up_consumer_is_never_dropped(ingest: Ingest) -> None:
    store = RecordingStore(ingest.store, hold_every=True)
    b = Broadcaster(store, ingest.bus, replay_batch=10, replay_bytes=1500, live_queue_max=15)
    await ingest.add(120)
    await b.start()
    try:
        async with serve(b, "websockets") as hp:
            reader = asyncio.create_task(collect(ws_url(hp, 0), until_seq=300, delay=0.002))
            await until(lambda: len(store.reads) >= 1)  # replaying; its first read is held
            await ingest.add(180, batch=30)  # live events meanwhile: 180 > its live buffer of 15
            await until(lambda: b.stats.replay_overflows >= 1)
            assert b.stats.too_slow == 0  # a replaying consumer's overflow is not "too slow"
            store.gate.set()
            got = await reader
        assert got == list(range(1, 301))  # everything, in order: the dropped buffer came from the store
        assert b.stats.replay_overflows == 1
        assert b.stats.too_slow == 0
    finally:
        await b.close()


@pytest.mark.parametrize("transport", ["websockets", "asgi", "asgi-batch"])
async def test_stalled_live_consumer_gets_too_slow_and_is_closed(ingest: Ingest, transport: str) -> None:
    # websockets: direct writes, limit = 1 MB of write buffer; asgi: queue of 30 frames
    b = Broadcaster(ingest.store, ingest.bus, live_queue_max=30, live_queue_bytes=1 << 20)
    await b.start()
    try:
        async with serve(b, transport) as hp:
            host, port = hp.split(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            healthy = asyncio.create_task(collect(ws_url(hp), until_seq=400))
            async with connect(ws_url(hp), sock=sock, max_queue=1, max_size=None) as stalled:
                await until(lambda: b.consumer_count == 2)
                await ingest.add(400, batch=10, payload=b"z" * 32768)  # ~13 MB: fills every buffer
                await until(lambda: b.stats.too_slow == 1, timeout=15)
                await until(lambda: b.consumer_count == 1, timeout=15)
                # the stalled consumer's connection is closed by the server
                with pytest.raises(ConnectionClosed):
                    async with asyncio.timeout(15):
                        while True:
                            await stalled.recv()
            assert await healthy == list(range(1, 401))
    finally:
        await b.close()


@pytest.mark.parametrize("transport", ["websockets", "asgi", "asgi-batch"])
async def test_pre_upgrade_http_errors(ingest: Ingest, transport: str) -> None:
    b = Broadcaster(ingest.store, ingest.bus, max_consumers=0)
    await b.start()
    try:
        async with serve(b, transport) as hp:
            url = ws_url(hp).replace("ws://", "http://")
            async with httpx.AsyncClient(timeout=5) as http:
                assert (await http.post(url)).status_code == 405
                assert (await http.get(url)).status_code == 426
            with pytest.raises(InvalidStatus) as err:
                async with connect(ws_url(hp)):
                    pass
            assert err.value.response.status_code == 429
            with pytest.raises(InvalidStatus) as err:
                async with connect(ws_url(hp).replace("?", "") + "?cursor=-4"):
                    pass
            assert err.value.response.status_code == 400
    finally:
        await b.close()


@pytest.mark.parametrize("transport", ["websockets", "asgi", "asgi-batch"])
async def test_slow_live_consumer_receives_consumer_too_slow(ingest: Ingest, transport: str) -> None:
    b = Broadcaster(ingest.store, ingest.bus, live_queue_max=5, live_queue_bytes=256 * 1024)
    await b.start()
    try:
        async with serve(b, transport) as hp:
            reader = asyncio.create_task(collect(ws_url(hp), until_seq=10_000, delay=0.003, rcvbuf=4096))
            await until(lambda: b.consumer_count == 1)
            await ingest.add(400, batch=20, payload=b"s" * 32768)
            got = await asyncio.wait_for(reader, 30)
        assert got[-1] == ("error", "ConsumerTooSlow")
        seqs = got[:-1]
        assert seqs == list(range(1, len(seqs) + 1))  # in order, no gap, until the cut
        assert b.stats.too_slow == 1
    finally:
        await b.close()


async def test_handoff_over_redis_bus(ingest: Ingest, redis_url: str) -> None:
    """The scale-out path: the sequencer side publishes to Redis, a fan-out replica follows it."""
    import uuid

    from firehose.bus import RedisStreamBus

    stream = f"test:fh:{uuid.uuid4().hex}"
    publisher = RedisStreamBus(redis_url, stream)
    follower = RedisStreamBus(redis_url, stream, block_ms=50)
    ingest.bus = publisher
    try:
        await ingest.add(100)
        b = Broadcaster(ingest.store, follower, replay_batch=20)
        await b.start()
        target = 400
        async with serve(b, "websockets") as hp:
            writer = asyncio.create_task(ingest.add(300, batch=9))
            readers = []
            for cursor in (0, 50, None):
                readers.append((cursor, asyncio.create_task(collect(ws_url(hp, cursor), until_seq=target))))
                await asyncio.sleep(0.01)
            await writer
            for cursor, task in readers:
                got = await asyncio.wait_for(task, 30)
                if cursor is None:  # live-only: a contiguous tail ending at the target
                    assert got == list(range(got[0], target + 1))
                else:
                    assert got == list(range(cursor + 1, target + 1))
        await b.close()
    finally:
        await publisher.redis.delete(stream)
        await publisher.close()
        await follower.close()


async def test_window_trimmed_under_a_slow_replay_is_announced(ingest: Ingest) -> None:
    old = time.time() - 3600
    await ingest.add(40, when=old)
    await ingest.add(10)
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=5)
    await b.start()
    try:
        batches = b.session(0).frame_batches()
        first = [decode_frame(raw).body["seq"] for raw in await anext(batches)]
        assert first == [1, 2, 3, 4, 5]  # one store read
        assert await ingest.store.trim(older_than_seconds=60) == 40  # the window moves on
        rest: list[object] = []
        while 50 not in rest:
            for raw in await asyncio.wait_for(anext(batches), 5):
                f = decode_frame(raw)
                rest.append(("info", f.body["name"]) if f.t == "#info" else f.body["seq"])
        # The replay reads one batch ahead while sending: that batch (6-10) may have been read
        # before the trim, and is then delivered. Either way the jump to 41 is announced.
        assert rest in ([("info", "OutdatedCursor"), *range(41, 51)],
                        [*range(6, 11), ("info", "OutdatedCursor"), *range(41, 51)])
        await batches.aclose()
    finally:
        await b.close()


def _seqs_and_infos(batch) -> list:
    """A session's events as seqs, its own messages as (kind, seq, decoded body)."""
    return [ev.seq if ev.kind == "#commit" else (ev.kind, ev.seq, decode_frame(ev.frame).body) for ev in batch]


async def test_window_trimmed_before_the_first_read_is_announced(ingest: Ingest) -> None:
    """A cursor older than the window gets the connection-time ``#info``; then the window moves
    between another session's connection-time check (its cursor 2 is just before the window) and
    its first read: the jump from seq 2 (the cursor) to 4 is announced too. Both are session
    messages (kind ``#info``, seq 0) with their reason, each counted."""
    now = time.time()
    await ingest.add(2, when=now - 7200)
    await ingest.add(1, when=now - 3600)
    await ingest.add(7)
    assert await ingest.store.trim(older_than_seconds=5400) == 2  # the window is 3..10
    store = RecordingStore(ingest.store, hold_every=True)
    store.gate.set()
    b = Broadcaster(store, ingest.bus, replay_batch=50)
    await b.start()
    outdated = b.session(1).event_batches()
    try:
        info = await anext(outdated)
        assert _seqs_and_infos(info) == [
            ("#info", 0, {"name": "OutdatedCursor", "message": "cursor is older than the backfill window"})]
        # the JSON stream is handed session messages too: they convert to nothing, without failing
        assert select(JetstreamConverter(ZstdCodec.default()), info, parse_options([], []), None).messages == []
        assert _seqs_and_infos(await anext(outdated)) == list(range(3, 11))
    finally:
        await outdated.aclose()
    assert b.stats.outdated_cursor == 1
    store.gate.clear()
    batches = b.session(2).event_batches()
    try:
        first = asyncio.ensure_future(anext(batches))
        await until(lambda: len(store.reads) == 2, "the replay's first read, held before it is made")
        assert await ingest.store.trim(older_than_seconds=60) == 1  # seq 3: the window is 4..10
        store.gate.set()
        assert _seqs_and_infos(await first) == [
            ("#info", 0, {"name": "OutdatedCursor", "message": "events were trimmed while replaying"}),
            *range(4, 11)]
        assert b.stats.outdated_cursor == 2
    finally:
        await batches.aclose()
        await b.close()


async def test_a_replaying_session_is_stalled_only_while_its_batch_waits(ingest: Ingest) -> None:
    """``replay_stalled_since``: None before; the broadcaster's clock when the replay handed its connection a
    batch; None once the connection took it and the session waits for its next read, and once
    the replay is over."""
    await ingest.add(10)
    store = RecordingStore(ingest.store, hold=2)
    b = Broadcaster(store, ingest.bus, replay_batch=5, clock=lambda: 42.0)
    await b.start()
    session = b.session(0)
    assert session.replay_stalled_since is None
    batches = session.event_batches()
    try:
        assert [e.seq for e in await anext(batches)] == [1, 2, 3, 4, 5]
        assert session.replay_stalled_since == 42.0
        await asyncio.wait_for(store.held.wait(), 10)  # the read ahead took its bytes and is held
        held = b.replay_budget.used
        following = asyncio.ensure_future(anext(batches))
        await until(lambda: b.replay_budget.used < held, "the first batch given back")
        assert session.replay_stalled_since is None
        store.gate.set()
        assert [e.seq for e in await asyncio.wait_for(following, 10)] == [6, 7, 8, 9, 10]
        live = asyncio.ensure_future(anext(batches))
        await until(lambda: session.live, "caught up: the session is live")
        assert session.replay_stalled_since is None
        live.cancel()
        with pytest.raises(asyncio.CancelledError):
            await live
    finally:
        await batches.aclose()
        await b.close()


async def test_window_trimmed_past_cursor_one_is_announced(ingest: Ingest) -> None:
    """Cursor 1 (inside the window when the session connects) and the window moving to 3..10
    before its first read: the jump from seq 1 to 3 is announced, counted once."""
    now = time.time()
    await ingest.add(2, when=now - 3600)
    await ingest.add(8)
    store = RecordingStore(ingest.store, hold_every=True)
    b = Broadcaster(store, ingest.bus, replay_batch=50)
    await b.start()
    batches = b.session(1).event_batches()
    try:
        first = asyncio.ensure_future(anext(batches))
        await until(lambda: len(store.reads) == 1, "the replay's first read, held before it is made")
        assert await ingest.store.trim(older_than_seconds=60) == 2  # the window is 3..10
        store.gate.set()
        assert _seqs_and_infos(await first) == [
            ("#info", 0, {"name": "OutdatedCursor", "message": "events were trimmed while replaying"}),
            *range(3, 11)]
        assert b.stats.outdated_cursor == 1
    finally:
        await batches.aclose()
        await b.close()


@pytest.mark.parametrize("frames", [False, True])
@pytest.mark.parametrize("cursor", [0, 120])
async def test_live_events_dropped_while_replaying_are_read_again(ingest: Ingest, cursor: int, frames: bool) -> None:
    """A replaying session whose live queue overflows forgets it (the store has those events)
    and, once caught up, reads again from the last seq it sent — also for ``cursor = latest``,
    which has nothing to replay — before it goes live; every read is one batch. ``frames``:
    a session of frames gets frames from the read again too."""
    await ingest.add(120)
    store = RecordingStore(ingest.store, hold=1)
    b = Broadcaster(store, ingest.bus, replay_batch=500, live_queue_max=15)
    await b.start()
    session = b.session(cursor)
    batches = session.frame_batches() if frames else session.event_batches()

    def seqs(batch: list) -> list:
        return [decode_frame(raw).body["seq"] for raw in batch] if frames else _seqs_and_infos(batch)

    got: list[int] = []
    try:
        first = asyncio.ensure_future(anext(batches))
        await store.held.wait()  # the first read is made (1..120, or nothing): held there
        await ingest.add(180, batch=30)  # live meanwhile: 180 > its live queue of 15
        await until(lambda: b.stats.replay_overflows == 1, "the live queue's overflow")
        store.gate.set()
        got.extend(seqs(await first))
        while not got or got[-1] < 300:
            got.extend(seqs(await anext(batches)))
        assert got == list(range(cursor + 1, 301))  # what the overflow dropped came from the store
        await ingest.add(1)
        assert seqs(await anext(batches)) == [301]
        assert session.live
        assert store.reads == [(cursor, 500), (120, 500)]  # the 301st came live
    finally:
        await batches.aclose()
        await b.close()


async def test_replay_reads_are_bounded_by_bytes(ingest: Ingest) -> None:
    """After each read the next one asks for about ``replay_bytes`` worth of the frames just read:
    ``replay_bytes // average frame`` (whole bytes; at least one), never more than ``replay_batch``."""
    for i in range(12):
        await ingest.add(1, payload=b"x" * (300 + i % 2))  # frames of f and f + 1 bytes, in turn
    frame = len((await ingest.store.read_after(0, 1))[0].frame)
    store = RecordingStore(ingest.store)
    b = Broadcaster(store, ingest.bus, replay_batch=5, replay_bytes=frame * 3)  # each average is f + a fraction
    batches = b.session(0).event_batches()
    try:
        assert [len(await anext(batches)) for _ in range(4)] == [5, 3, 3, 1]
        assert store.reads == [(0, 5), (5, 3), (8, 3), (11, 3)]
    finally:
        await batches.aclose()
    store = RecordingStore(ingest.store)
    b = Broadcaster(store, ingest.bus, replay_batch=5, replay_bytes=frame - 1)  # not even one frame
    batches = b.session(0).event_batches()
    try:
        assert [len(await anext(batches)) for _ in range(3)] == [5, 1, 1]
        assert store.reads[:3] == [(0, 5), (5, 1), (6, 1)]
    finally:
        await batches.aclose()


async def test_a_read_ahead_expects_the_frames_its_own_session_read(ingest: Ingest) -> None:
    """The read ahead asks for ``replay_bytes`` worth of the frames its session just read, even
    when another session's read has set the broadcaster's ``frame_estimate`` (what only a first
    read goes by) since: here, before the read ahead starts, one of 1-byte frames."""
    for _ in range(12):
        await ingest.add(1, payload=b"x" * 300)
    frame = len((await ingest.store.read_after(0, 1))[0].frame)
    store = RecordingStore(ingest.store)
    b = Broadcaster(store, ingest.bus, replay_batch=5, replay_bytes=frame * 3)
    batches = b.session(0).event_batches()
    try:
        assert len(await anext(batches)) == 5  # handed over; its read ahead is made next
        assert b.frame_estimate == frame
        b.frame_estimate = 1  # another session's read of tiny frames, in between
        assert len(await anext(batches)) == 3
        assert store.reads[:2] == [(0, 5), (5, 3)]
    finally:
        await batches.aclose()


async def test_the_read_again_after_an_overflow_expects_the_frames_its_session_read(ingest: Ingest) -> None:
    """The read again after a replay overflow also asks for ``replay_bytes`` worth of the frames its
    session last read, not of the broadcaster's ``frame_estimate`` another session's read set."""
    await ingest.add(12, payload=b"x" * 300)
    frame = len((await ingest.store.read_after(0, 1))[0].frame)
    store = RecordingStore(ingest.store, hold=1)
    b = Broadcaster(store, ingest.bus, replay_batch=50, replay_bytes=frame * 30, live_queue_max=15)
    await b.start()
    batches = b.session(0).event_batches()
    try:
        first = asyncio.ensure_future(anext(batches))
        await store.held.wait()  # the first read (1..12, not full) is made: held there
        await ingest.add(40, batch=20, payload=b"x" * 300)  # live meanwhile: 40 > its live queue of 15
        await until(lambda: b.stats.replay_overflows == 1, "the live queue's overflow")
        store.gate.set()
        assert [e.seq for e in await first] == list(range(1, 13))
        b.frame_estimate = 1  # another session's read of tiny frames, in between
        assert [e.seq for e in await anext(batches)] == list(range(13, 43))
        assert store.reads[:2] == [(0, 50), (12, 30)]
    finally:
        await batches.aclose()
        await b.close()


async def test_the_read_again_after_an_overflow_goes_before_reads_ahead(ingest: Ingest) -> None:
    """The read again after a replay overflow is the read of a session that holds nothing: in the
    replay budget it goes before a read ahead that waited longer (and does not fit yet)."""
    await ingest.add(12, payload=b"x" * 300)
    frame = len((await ingest.store.read_after(0, 1))[0].frame)
    store = RecordingStore(ingest.store, hold=1)
    b = Broadcaster(store, ingest.bus, replay_batch=50, replay_bytes=frame * 30, live_queue_max=15,
                    replay_budget_bytes=frame * 400)
    budget = b.replay_budget
    await b.start()
    batches = b.session(0).event_batches()
    other: asyncio.Future[None] | None = None
    try:
        first = asyncio.ensure_future(anext(batches))
        await store.held.wait()  # the first read (1..12, not full) is made: held there
        await ingest.add(40, batch=20, payload=b"x" * 300)  # live meanwhile: 40 > its live queue of 15
        await until(lambda: b.stats.replay_overflows == 1, "the live queue's overflow")
        store.gate.set()
        assert [e.seq for e in await first] == list(range(1, 13))
        await budget.take(frame * 100)  # another session's batch
        other = asyncio.ensure_future(budget.take(frame * 400, ahead=True))  # its read ahead
        await until(lambda: budget.waiting == 1, "the other read ahead in line")
        following = asyncio.ensure_future(anext(batches))
        await until(lambda: budget.waiting == 2, "the read again in line")
        budget.give(frame)  # room for the read again, not for the read ahead
        assert budget.waiting == 1
        assert [e.seq for e in await asyncio.wait_for(following, 10)] == list(range(13, 43))
        assert store.reads[:2] == [(0, 50), (12, 30)]
    finally:
        if other is not None:
            other.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await other
        await batches.aclose()
        await b.close()


async def test_by_default_a_replay_read_is_at_most_500_events(ingest: Ingest) -> None:
    """With its defaults a broadcaster's replay reads at most 500 events at a time (small frames:
    ``replay_bytes`` would allow more)."""
    await ingest.add(1003, batch=500)
    store = RecordingStore(ingest.store)
    b = Broadcaster(store, ingest.bus)
    batches = b.session(0).event_batches()
    try:
        assert [len(await anext(batches)) for _ in range(3)] == [500, 500, 3]
        assert [after for after, _ in store.reads[:3]] == [0, 500, 1000]
    finally:
        await batches.aclose()


async def test_a_failed_read_ahead_of_a_closed_session_is_retrieved(ingest: Ingest) -> None:
    """The read ahead fails while the first batch is out, then the consumer goes: the failure is
    retrieved when the session closes, not reported by asyncio as never retrieved."""
    await ingest.add(20)
    store = RecordingStore(ingest.store, fail=2)
    b = Broadcaster(store, ingest.bus, replay_batch=10)
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        batches = b.session(0).event_batches()
        assert len(await anext(batches)) == 10
        reads = [t for t in asyncio.all_tasks() if "read_after" in repr(t.get_coro())]
        assert len(reads) == 1  # the read ahead, made while the first batch is out
        await asyncio.wait(reads)
        assert len(store.reads) == 2 and reads[0].done()  # it failed; nobody has looked
        await batches.aclose()
        del reads, batches
        gc.collect()
        assert unretrieved == []
    finally:
        loop.set_exception_handler(previous)


async def test_live_lists_are_bounded_like_a_replay_batch(ingest: Ingest) -> None:
    """What a queued session takes per list: at most ``replay_batch`` events, and it stops once
    ``replay_bytes`` is reached (the frame that reaches it is the last)."""
    from firehose.state import SequencedEvent

    b = Broadcaster(ingest.store, ingest.bus, replay_batch=4, replay_bytes=300, live_queue_bytes=1000)  # not started
    batches = b.session(None).event_batches()

    async def lists_of(n: int) -> list[int]:
        return [len(await anext(batches)) for _ in range(n)]

    async def lists(first: asyncio.Future[list[SequencedEvent]] | None = None) -> list[int]:
        sizes: list[int] = [len(await first)] if first is not None else []
        while sum(sizes) < 10:
            sizes.append(len(await anext(batches)))
        return sizes

    try:
        waiting = asyncio.ensure_future(anext(batches))
        await until(lambda: b.consumer_count == 1, "the session registered")
        b.deliver([SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"x" * 10) for seq in range(1, 11)])
        assert await lists(waiting) == [4, 4, 2]
        b.deliver([SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"x" * 100) for seq in range(11, 21)])
        assert await lists() == [3, 3, 3, 1]
        # what is taken no longer counts against the live queue's byte limit (1,000 here)
        b.deliver([SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"x" * 100) for seq in range(21, 29)])
        assert await lists_of(1) == [3]  # 5 frames (500 bytes) still queued
        session = b.sessions[0]
        b.deliver([SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"x" * 100) for seq in range(29, 34)])
        assert not session.too_slow.is_set()  # 1,000 bytes queued: at the limit, not over it
        b.deliver([SequencedEvent(34, "did:plc:d", "#commit", 0.0, b"x" * 100)])
        assert session.too_slow.is_set()
    finally:
        await batches.aclose()


async def test_deliver_hands_each_event_on_once(ingest: Ingest) -> None:
    """``Broadcaster.deliver``: what was fanned out before is not handed on again — not even to a
    session that registered since (it has sent nothing, so it could not drop it itself); an empty
    or wholly old batch changes nothing."""
    from firehose.state import SequencedEvent

    def ev(seq: int) -> SequencedEvent:
        return SequencedEvent(seq, "did:plc:d", "#commit", 0.0, b"frame %d" % seq)

    b = Broadcaster(ingest.store, ingest.bus)  # not started: the test is the fan-out
    first, second = b.session(None), b.session(None)
    early = first.event_batches()
    got_early = asyncio.ensure_future(anext(early))
    await until(lambda: b.consumer_count == 1, "the first session registered")
    b.deliver([ev(1), ev(2)])
    assert [e.seq for e in await got_early] == [1, 2] and b.latest_seq == 2
    late = second.event_batches()
    got_late = asyncio.ensure_future(anext(late))
    await until(lambda: b.consumer_count == 2, "the second session registered")
    b.deliver([])
    b.deliver([ev(1), ev(2)])
    assert b.latest_seq == 2
    b.deliver([ev(2), ev(3)])
    assert [e.seq for e in await got_late] == [3]
    assert [e.seq for e in await anext(early)] == [3]
    assert b.latest_seq == 3
    await early.aclose()
    await late.aclose()
    assert b.consumer_count == 0


async def test_live_batches_are_framed_once_for_every_consumer(ingest: Ingest, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the main port caught-up consumers are written by the fan-out itself (``DIRECT_WRITE``):
    each live batch is framed once, whatever the number of consumers, and every consumer still
    gets every frame in order."""
    import firehose.serve_wire as serve_wire

    framed: list[int] = []
    real = serve_wire.binary_wire

    def counting(frames: list[bytes]) -> bytes:
        framed.append(len(frames))
        return real(frames)

    monkeypatch.setattr(serve_wire, "binary_wire", counting)
    b = Broadcaster(ingest.store, ingest.bus)
    await b.start()
    try:
        async with serve(b, "asgi-batch") as hp:
            readers = [asyncio.create_task(collect(ws_url(hp), until_seq=60)) for _ in range(3)]
            await until(lambda: b.consumer_count == 3)  # registered, hence writing directly
            await ingest.add(60, batch=10)
            got = await asyncio.wait_for(asyncio.gather(*readers), 20)
        assert got == [list(range(1, 61))] * 3
        assert sum(framed) == 60  # once per frame, not once per frame per consumer
    finally:
        await b.close()
