"""The JSON stream's slow-consumer rule, over real sockets (README, "The JSON stream"): each
``/subscribe`` connection is an ordinary broadcaster consumer, and one that cannot keep up live is
closed with 1008 ``ConsumerTooSlow`` while the others go on receiving everything.

The endpoint runs as the relay serves it (uvicorn with ``firehose.uvicorn_batch``: batched sends,
lag probes) over a real store and bus. Two ways to be too slow, as for ``subscribeRepos``: the live
queue overflows (a small one here, so a few large real commits overflow it), or the connection
does not take what was sent within ``max_lag`` (probed with pings, at any event rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backfill.backends import open_store
from backfill.store import BatchWrite, Store
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from firehose.frames import encode_frame
from firehose.jetstream import JetstreamConverter, ZstdCodec
from firehose.state import SequencedEvent
from relay.jetstream_server import JetstreamServer
from relay.routes import jetstream_routes
from tests.firehose.commits import commit_body, new_repo
from tests.relay.helpers import serve_asgi
from tests.waiting import until

RECORD_TEXT = "j" * 30_000  # ~30 KB per message: a few fill any socket buffer
EVENTS = 400  # ~12 MB: more than a stalled socket's buffers (up to 4 MB sent + its receive buffer) and the queue
MORE = 60  # live events while a consumer replays: more than its live queue holds
LIVE_QUEUE_MAX = 30
LIVE_QUEUE_BYTES = 1 << 20  # ~33 such events
#: events per replay read: a stalled replaying consumer holds at most its socket's buffers (~4 MB)
#: and one batch, far less than the window of EVENTS
REPLAY_BATCH = 20


class Producer:
    """Writes real ``#commit`` events (one big post each) the way the sequencer does, then publishes."""

    def __init__(self, store: Store, bus: InProcessBus, text: str = RECORD_TEXT) -> None:
        self.store = store
        self.bus = bus
        self.repo = new_repo("did:plc:slowjsonconsumer00000001")
        self.text = text
        self.seq = 0

    async def add(self, n: int, batch: int = 10, keep_up: Callable[[], int] | None = None) -> None:
        """``keep_up()``: how many events a healthy consumer has received; each batch then waits
        until it is at most one batch behind (its live queue never holds more than two batches)."""
        from mst.repo import Write

        lease = await self.store.acquire_writer(wait=True, timeout=10)
        try:
            while n > 0:
                events = []
                for _ in range(min(batch, n)):
                    self.seq += 1
                    r = self.repo.apply_writes([Write("create", "app.bsky.feed.post", f"3k{self.seq:011d}",
                                                      {"$type": "app.bsky.feed.post", "text": self.text})])
                    frame = encode_frame("#commit", commit_body(self.repo, r, self.seq))
                    events.append(SequencedEvent(self.seq, self.repo.did, "#commit", time.time(), frame))
                await lease.commit_batch(BatchWrite(expected_high_water=self.seq - len(events),
                                                    new_high_water=self.seq,
                                                    events=[(e.seq, e.did, e.kind, e.time, e.frame) for e in events]))
                await self.bus.publish(events)
                n -= len(events)
                if keep_up is not None:
                    behind = self.seq - len(events)
                    await until(lambda b=behind: keep_up() >= b, "the healthy consumer keeping up")  # type: ignore[misc]
                await asyncio.sleep(0)
        finally:
            await lease.release()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await open_store(str(tmp_path / "relay.sqlite"))
    await s.migrate()
    yield s
    await s.close()


@contextlib.asynccontextmanager
async def endpoint(store: Store, bus: InProcessBus, counted: list[str],
                   max_lag: float = 60.0) -> AsyncIterator[tuple[Broadcaster, str]]:
    broadcaster = Broadcaster(store, bus, live_queue_max=LIVE_QUEUE_MAX, live_queue_bytes=LIVE_QUEUE_BYTES,
                              replay_batch=REPLAY_BATCH, replay_bytes=REPLAY_BATCH * 40_000, max_lag=max_lag)
    await broadcaster.start()
    server = JetstreamServer(broadcaster, JetstreamConverter(ZstdCodec.default()), count=counted.append)
    try:
        async with serve_asgi(Starlette(routes=jetstream_routes(server))) as url:
            yield broadcaster, url.replace("http://", "ws://") + "/subscribe"
    finally:
        await broadcaster.close()


def small_socket(url: str) -> socket.socket:
    """A client socket with a 4 KB receive buffer (no autotuning): a consumer that stops reading
    stalls the server's sends soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = url.split("/")[2].split(":")
    sock.connect((host, int(port)))
    return sock


def rkeys(messages: list[dict[str, object]]) -> list[str]:
    return [m["commit"]["rkey"] for m in messages]  # type: ignore[index]


async def read_until_too_slow(ws: ClientConnection, got: list[dict[str, object]]) -> list[dict[str, object]]:
    """Read what a cut consumer still has coming: its messages in order with no gap (after ``got``,
    what it read before), then a 1008 ``ConsumerTooSlow`` close."""
    got = list(got)
    with pytest.raises(ConnectionClosed) as closed:
        async with asyncio.timeout(30):
            while True:
                got.append(json.loads(await ws.recv()))
    assert rkeys(got) == [f"3k{i:011d}" for i in range(1, len(got) + 1)]
    rcvd = closed.value.rcvd
    assert rcvd is not None and (rcvd.code, rcvd.reason) == (1008, "ConsumerTooSlow")
    return got


async def read_all(url: str, n: int, out: list[dict[str, object]], stay: asyncio.Event) -> list[dict[str, object]]:
    """Read ``n`` messages into ``out``, then stay connected until ``stay`` is set."""
    async with connect(url, max_size=None) as ws:
        while len(out) < n:
            out.append(json.loads(await ws.recv()))
        await stay.wait()
    return out


async def test_json_consumer_that_stops_reading_is_closed_too_slow(store: Store) -> None:
    bus = InProcessBus()
    producer = Producer(store, bus)
    counted: list[str] = []
    async with endpoint(store, bus, counted) as (broadcaster, url):
        healthy_got: list[dict[str, object]] = []
        leave = asyncio.Event()
        healthy = asyncio.create_task(read_all(url, EVENTS, healthy_got, leave))
        async with connect(url, sock=small_socket(url), max_size=None, max_queue=1) as stalled:
            await until(lambda: broadcaster.consumer_count == 2, "both consumers registered")
            await producer.add(3, keep_up=lambda: len(healthy_got))
            first = [json.loads(await stalled.recv()) for _ in range(3)]
            assert rkeys(first) == [f"3k{i:011d}" for i in (1, 2, 3)]
            # now it stops reading: its socket fills, then its live queue
            await producer.add(EVENTS - 3, keep_up=lambda: len(healthy_got))
            await until(lambda: broadcaster.stats.too_slow == 1, "the stalled consumer cut", timeout=30)
            await until(lambda: broadcaster.consumer_count == 1, "its session ended", timeout=30)
            assert counted.count("too_slow") == 1
            # what it reads when it resumes: messages in order with no gap, then the close
            got = await read_until_too_slow(stalled, first)
            assert len(got) < EVENTS
        # the other consumer got every event, in order
        leave.set()
        assert rkeys(await asyncio.wait_for(healthy, 30)) == [f"3k{i:011d}" for i in range(1, EVENTS + 1)]


async def test_slow_reading_json_consumer_is_closed_too_slow_and_a_replaying_one_is_not(store: Store) -> None:
    """A consumer reading slowly live is cut; one replaying from a cursor is not, however far
    behind it falls (README: "a consumer catching up from the past is never dropped")."""
    bus = InProcessBus()
    producer = Producer(store, bus)
    counted: list[str] = []
    async with endpoint(store, bus, counted) as (broadcaster, url):
        await producer.add(5)
        slow_got: list[dict[str, object]] = []

        async def slow() -> ConnectionClosed:
            async with connect(url, sock=small_socket(url), max_size=None, max_queue=1) as ws:
                try:
                    while True:
                        slow_got.append(json.loads(await ws.recv()))
                        await asyncio.sleep(0.01)
                except ConnectionClosed as exc:
                    return exc

        slow_task = asyncio.create_task(slow())
        await until(lambda: broadcaster.consumer_count == 1, "the slow consumer registered")
        await producer.add(EVENTS - 5)
        closed = await asyncio.wait_for(slow_task, 60)
        assert closed.rcvd is not None and (closed.rcvd.code, closed.rcvd.reason) == (1008, "ConsumerTooSlow")
        assert slow_got and rkeys(slow_got) == [f"3k{i:011d}" for i in range(6, 6 + len(slow_got))]
        assert len(slow_got) < EVENTS - 5
        assert broadcaster.stats.too_slow == 1 and counted.count("too_slow") == 1
        # a consumer replaying the window that stops reading while more live events arrive than
        # its live queue holds is not cut: it gets everything once it reads again
        replayed: list[dict[str, object]] = []
        resume = asyncio.Event()

        async def replaying() -> None:
            async with connect(url + "?cursor=0", sock=small_socket(url), max_size=None, max_queue=1) as ws:
                while len(replayed) < EVENTS + MORE:
                    replayed.append(json.loads(await ws.recv()))
                    if len(replayed) == 10:
                        await resume.wait()

        replay_task = asyncio.create_task(replaying())
        await until(lambda: len(replayed) >= 10, "the replay under way")
        await producer.add(MORE)
        assert broadcaster.stats.replay_overflows >= 1  # its live queue overflowed while it replayed
        resume.set()
        await asyncio.wait_for(replay_task, 60)
        assert rkeys(replayed) == [f"3k{i:011d}" for i in range(1, EVENTS + MORE + 1)]
        assert broadcaster.stats.too_slow == 1


async def test_json_consumer_that_stops_reading_at_a_low_rate_is_cut_by_lag(store: Store) -> None:
    """A few small events, far below the live queue's bounds: the consumer that stops reading is
    still told ConsumerTooSlow, by the lag probe, within ``max_lag`` (README: "at one event a
    minute as at thousands a second"); the one that reads is never cut."""
    bus = InProcessBus()
    producer = Producer(store, bus, text="small")
    counted: list[str] = []
    async with endpoint(store, bus, counted, max_lag=1.0) as (broadcaster, url):
        leave = asyncio.Event()
        healthy_got: list[dict[str, object]] = []
        healthy = asyncio.create_task(read_all(url, 12, healthy_got, leave))
        async with connect(url, sock=small_socket(url), max_size=None, max_queue=1) as stalled:
            await until(lambda: broadcaster.consumer_count == 2, "both consumers registered")
            await producer.add(2, keep_up=lambda: len(healthy_got))
            first = [json.loads(await stalled.recv()) for _ in range(2)]
            assert rkeys(first) == [f"3k{i:011d}" for i in (1, 2)]
            # stops reading; one small event at a time, each after the healthy consumer has it
            for _ in range(10):
                await producer.add(1, keep_up=lambda: len(healthy_got))
                if broadcaster.stats.lagged:
                    break
            await until(lambda: broadcaster.stats.lagged == 1, "the lag probe unanswered", timeout=30)
            assert broadcaster.stats.too_slow == 1 and counted.count("too_slow") == 1
            await until(lambda: broadcaster.consumer_count == 1, "its session ended", timeout=30)
            await read_until_too_slow(stalled, first)
        await producer.add(12 - producer.seq, keep_up=lambda: len(healthy_got))
        leave.set()
        assert rkeys(await asyncio.wait_for(healthy, 30)) == [f"3k{i:011d}" for i in range(1, 13)]
        assert broadcaster.stats.too_slow == 1
