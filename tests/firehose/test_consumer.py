"""``firehose.consumer.RelayConsumer`` over real sockets, against a scripted relay.

The scripted server speaks subscribeRepos as a test wants it to (cursors are exclusive: a cursor
N sends ``seq > N``): it can resend events at or before the cursor (the overlap of a server that
counts cursors inclusively), drop the connection after a few frames, say
``#info OutdatedCursor`` or answer ``FutureCursor``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, serve

from firehose.backoff import Backoff
from firehose.consumer import Checkpoint, Event, FileCursorStore, MemoryCursorStore, RelayConsumer
from firehose.frames import encode_error_frame, encode_frame, encode_info_frame

DID = "did:plc:consumertest0000000000000"


def frame(seq: int) -> bytes:
    return encode_frame("#identity", {"did": DID, "seq": seq, "time": "2026-01-01T00:00:00.000Z"})


@dataclass
class Script:
    oldest: int = 1
    latest: int = 20
    overlap: int = 0  # resend this many events at or before the cursor
    cut_after: int | None = None  # frames per connection, then drop it
    cursors: list[int | None] = field(default_factory=list)
    live: asyncio.Event = field(default_factory=asyncio.Event)

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        q = parse_qs(urlsplit(ws.request.path).query).get("cursor")
        cursor = int(q[0]) if q else None
        self.cursors.append(cursor)
        if cursor is not None and cursor > self.latest:
            await ws.send(encode_error_frame("FutureCursor", "cursor is ahead"))
            await ws.close()
            return
        start = self.latest + 1 if cursor is None else cursor + 1
        if cursor and cursor + 1 < self.oldest:
            await ws.send(encode_info_frame("OutdatedCursor", "too old"))
            start = self.oldest
        sent = 0
        for seq in range(max(self.oldest, start - self.overlap), self.latest + 1):
            await ws.send(frame(seq))
            sent += 1
            if self.cut_after is not None and sent >= self.cut_after:
                return  # drops the connection
        if cursor is None:  # live: a few new events
            for seq in range(self.latest + 1, self.latest + 6):
                await ws.send(frame(seq))
        await ws.wait_closed()


@contextlib.asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[str]:
    async with serve(script.handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}"


async def take(consumer: RelayConsumer, n: int, *, ack: bool = True) -> list[Event]:
    out: list[Event] = []
    async with asyncio.timeout(20):
        async for ev in consumer:
            out.append(ev)
            if ack:
                consumer.done(ev)
            if len(out) >= n:
                break
    return out


async def test_reconnects_and_drops_the_overlap() -> None:
    script = Script(overlap=1, cut_after=6)
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor=0, backoff=Backoff(0.01, 0.05))
        events = await take(consumer, 20)
    assert [e.seq for e in events] == list(range(1, 21))
    assert consumer.connections >= 4
    assert consumer.duplicates_dropped >= 3
    # exclusive cursors: each reconnect asks for what follows the last seq received
    assert script.cursors[:3] == [0, 6, 11]


async def test_reconnects_with_the_last_seq_received_and_is_resent_nothing() -> None:
    """Against a server that counts cursors as every relay does (``seq > cursor``), each
    reconnect asks for what follows the last seq received: nothing is resent, nothing skipped."""
    script = Script(cut_after=5)
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor=3, backoff=Backoff(0.01, 0.05))
        events = await take(consumer, 17)
    assert [e.seq for e in events] == list(range(4, 21))
    assert script.cursors[:4] == [3, 8, 13, 18]
    assert consumer.duplicates_dropped == 0


async def test_outdated_cursor_is_an_explicit_gap() -> None:
    script = Script(oldest=10, latest=15)
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor_store=MemoryCursorStore(3))
        events = await take(consumer, 7)
    assert (events[0].kind, events[0].seq) == ("gap", 3)
    assert [e.seq for e in events[1:]] == list(range(10, 16))


async def test_future_cursor_is_reported_then_live() -> None:
    script = Script(latest=20)
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor=100, backoff=Backoff(0.01, 0.05))
        events = await take(consumer, 6)
    assert (events[0].kind, events[0].seq) == ("future_cursor", 100)
    assert [e.seq for e in events[1:]] == list(range(21, 26))
    assert script.cursors == [100, None]


def test_checkpoint_is_the_contiguous_applied_watermark() -> None:
    cp = Checkpoint()
    for seq in (5, 6, 7, 9):
        cp.received(seq)
    assert cp.watermark == 4
    cp.applied(7)
    cp.applied(6)
    assert cp.watermark == 4  # 5 is still being applied
    cp.applied(5)
    assert cp.watermark == 8  # 9 is not applied (seqs need not be consecutive)
    cp.applied(9)
    assert cp.watermark == 9


async def test_parallel_handlers_save_only_what_every_event_below_has_applied(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = Script(latest=12)
    store = FileCursorStore(tmp_path / "cursor")
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor_store=store, cursor=0, save_interval=0.0)
        held: list[Event] = []
        async with consumer:
            async with asyncio.timeout(20):
                async for ev in consumer:
                    if ev.seq == 3:
                        held.append(ev)  # a slow handler: still running
                    else:
                        consumer.done(ev)
                    if ev.seq == 12:
                        break
            await consumer.save()
            assert await store.load() == 2  # events 4..12 are applied, 3 is not: resume after 2
            consumer.done(held[0])
        assert await store.load() == 12
        # a new process resumes from the saved cursor
        again = RelayConsumer(url, cursor_store=store)
        script.latest = 15
        events = await take(again, 3)
    assert [e.seq for e in events] == [13, 14, 15]


async def test_in_flight_bound_stops_reading() -> None:
    script = Script(latest=10)
    async with scripted(script) as url:
        consumer = RelayConsumer(url, cursor=0, max_in_flight=3)
        got: list[Event] = []

        async def read() -> None:
            async for ev in consumer:
                got.append(ev)

        task = asyncio.create_task(read())
        async with asyncio.timeout(10):
            while len(got) < 3:
                await asyncio.sleep(0.01)
        # the 4th event is read only once an event is applied: the socket is not read meanwhile
        assert [e.seq for e in got] == [1, 2, 3] and consumer.checkpoint.in_flight == 3
        consumer.done(got[0])
        async with asyncio.timeout(10):
            while len(got) < 4:
                await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
