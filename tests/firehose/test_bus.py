"""Event buses: in-process and Redis Streams (real Redis, db 15)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from firehose.broadcast import Broadcaster
from firehose.bus import BusClosed, InProcessBus, RedisStreamBus, RedisTimeouts, redis_client
from firehose.state import SequencedEvent
from tests.waiting import until, until_async

from .conftest import Ingest, commit_frame

pytestmark = pytest.mark.timeout(60)


def ev(seq: int) -> SequencedEvent:
    return SequencedEvent(seq, "did:plc:x", "#commit", time.time(), commit_frame(seq))


async def test_in_process_bus_orders_and_positions() -> None:
    bus = InProcessBus()
    a = bus.subscribe()
    b = bus.subscribe(after_seq=3)
    await bus.publish([ev(1), ev(2), ev(3)])
    await bus.publish([ev(4)])
    assert [e.seq for e in await a.next_batch()] == [1, 2, 3]
    assert [e.seq for e in await a.next_batch()] == [4]
    assert [e.seq for e in await b.next_batch()] == [4]
    await a.close()
    with pytest.raises(BusClosed):
        await a.next_batch()


async def test_in_process_bus_backpressures_publisher() -> None:
    bus = InProcessBus(maxsize=2)
    sub = bus.subscribe()
    await bus.publish([ev(1)])
    await bus.publish([ev(2)])
    blocked = asyncio.create_task(bus.publish([ev(3)]))
    # the queue is full: publish waits for room (nothing is dropped)
    await until(lambda: bool(getattr(sub._queue, "_putters", None)) or blocked.done(), "publish waiting for room")
    assert not blocked.done()
    assert [e.seq for e in await sub.next_batch()] == [1]
    await asyncio.wait_for(blocked, 5)
    assert [e.seq for e in await sub.next_batch()] == [2]
    assert [e.seq for e in await sub.next_batch()] == [3]


@pytest.fixture
async def redis_bus(redis_url: str):
    stream = f"test:fh:{uuid.uuid4().hex}"
    bus = RedisStreamBus(redis_url, stream, block_ms=100)
    yield bus
    await bus.redis.delete(stream)
    await bus.close()


async def test_redis_bus_round_trip_and_positions(redis_bus: RedisStreamBus) -> None:
    live = redis_bus.subscribe()  # from "now"
    first = asyncio.create_task(live.next_batch())
    await until(lambda: live._last_id is not None, "the subscription's position taken")  # "now": before ev(1)
    await redis_bus.publish([ev(1), ev(2)])
    got = await asyncio.wait_for(first, 5)
    if len(got) == 1:  # a blocked XREAD may be served after the first XADD of the pipeline
        got += await asyncio.wait_for(live.next_batch(), 5)
    assert [e.seq for e in got] == [1, 2]
    assert got[0].frame == commit_frame(1) and got[1].extra == {"prev_seq": 1}
    after = redis_bus.subscribe(after_seq=1)
    assert [e.seq for e in await asyncio.wait_for(after.next_batch(), 5)] == [2]
    with pytest.raises(Exception):  # noqa: B017 - redis rejects an ID not above the last one
        await redis_bus.publish([ev(2)])
    await live.close()
    await after.close()


@contextlib.asynccontextmanager
async def live_frames(b: Broadcaster, timeout: float = 10.0) -> AsyncIterator[Callable[[int], Awaitable[list[bytes]]]]:
    """A live session registered on ``b`` before ``b`` starts (from seq 0); yields ``take(n)``,
    the session's first ``n`` frames. Closes the session and ``b`` on the way out."""
    batches = b.session(None).frame_batches()
    first = asyncio.create_task(anext(batches))
    await until(lambda: b.consumer_count == 1, "the session to register", timeout)
    await b.start(after_seq=0)
    got: list[bytes] = []

    async def take(n: int) -> list[bytes]:
        if not got:
            got.extend(await asyncio.wait_for(first, timeout))
        while len(got) < n:
            got.extend(await asyncio.wait_for(anext(batches), timeout))
        return got

    try:
        yield take
    finally:
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
        await batches.aclose()
        await b.close()


async def test_redis_trim_gap_is_filled_from_the_store(ingest: Ingest, redis_url: str) -> None:
    stream = f"test:fh:{uuid.uuid4().hex}"
    publisher = RedisStreamBus(redis_url, stream, maxlen=5, approximate_trim=False)
    consumer = RedisStreamBus(redis_url, stream, block_ms=100)
    try:
        ingest.bus = publisher
        await ingest.add(20)  # the stream now only holds seq 16..20 (prev of 16 is 15)
        assert await publisher.redis.xlen(stream) == 5
        b = Broadcaster(ingest.store, consumer)
        async with live_frames(b) as take:
            assert await take(20) == [commit_frame(i) for i in range(1, 21)]
            assert b.stats.bus_gaps_filled == 1
    finally:
        await publisher.redis.delete(stream)
        await publisher.close()
        await consumer.close()


async def test_fan_out_survives_bus_errors(ingest: Ingest) -> None:
    dead = RedisStreamBus("redis://127.0.0.1:1/15", "test:fh:dead")  # nothing listens on port 1
    b = Broadcaster(ingest.store, dead)
    await b.start()
    try:
        await until(lambda: b.stats.bus_errors >= 2, "two bus errors", timeout=10)
        assert b._task is not None and not b._task.done()  # still retrying, not crashed
    finally:
        await b.close()
        await dead.close()


class LossyBus:
    """A real bus whose publishes of the chosen seqs are lost (a failed publish, or an ingest
    that died between its commit and its publish)."""

    def __init__(self, inner: RedisStreamBus, lose: set[int]) -> None:
        self.inner = inner
        self.lose = lose

    async def publish(self, events: list[SequencedEvent]) -> None:
        kept = [e for e in events if e.seq not in self.lose]
        if kept:
            await self.inner.publish(kept)


@pytest.mark.parametrize("lost", [{3, 4}, {1}, {7}, {2, 5, 9}], ids=["run", "first", "inside", "scattered"])
async def test_a_lost_publish_is_never_a_hole(ingest: Ingest, redis_url: str, lost: set[int]) -> None:
    """Events stored but never published (before a batch or inside one) reach live consumers from
    the store, in order, before anything after them — without relying on the publisher's marker."""
    stream = f"test:fh:{uuid.uuid4().hex}"
    publisher = RedisStreamBus(redis_url, stream)
    consumer = RedisStreamBus(redis_url, stream, block_ms=100)
    try:
        b = Broadcaster(ingest.store, consumer)
        async with live_frames(b) as take:
            ingest.bus = LossyBus(publisher, lost)
            publisher._last_published = None  # a restarted ingest knows no previous seq
            await ingest.add(10, batch=10)
            assert await take(10) == [commit_frame(i) for i in range(1, 11)]
            assert b.stats.bus_gaps_filled >= 1
    finally:
        await publisher.redis.delete(stream)
        await publisher.close()
        await consumer.close()


async def test_bus_down_the_fan_out_follows_the_store(ingest: Ingest) -> None:
    """Redis unreachable: what is stored still reaches live consumers (from the store)."""
    dead = RedisStreamBus("redis://127.0.0.1:1/15", "test:fh:dead")  # nothing listens on port 1
    b = Broadcaster(ingest.store, dead)
    try:
        async with live_frames(b) as take:
            ingest.bus = InProcessBus()  # the ingest publishes elsewhere; this fan-out sees only the store
            await ingest.add(5)
            assert await take(5) == [commit_frame(i) for i in range(1, 6)]
            assert b.stats.bus_errors >= 1
    finally:
        await dead.close()


async def test_in_process_subscriptions_close_and_the_head_is_the_last_published() -> None:
    bus = InProcessBus(maxsize=1)
    assert await bus.head() is None
    await bus.publish([])  # nothing: no head, nothing delivered
    assert await bus.head() is None
    kept, closed = bus.subscribe(), bus.subscribe()
    await bus.publish([ev(1)])
    assert await bus.head() == 1
    await closed.close()  # its queue is full (maxsize 1): the close marker does not fit
    await closed.close()  # idempotent
    assert [e.seq for e in await kept.next_batch()] == [1]
    await bus.publish([ev(2)])  # the closed subscription is no longer fed (nor holds the publisher)
    assert await bus.head() == 2 and [e.seq for e in await kept.next_batch()] == [2]
    assert [e.seq for e in await closed.next_batch()] == [1]  # what it held, then closed
    with pytest.raises(BusClosed):
        await closed.next_batch()
    await bus.close()
    with pytest.raises(BusClosed):
        await kept.next_batch()


async def test_redis_bus_bounds_and_fields(redis_bus: RedisStreamBus, redis_url: str) -> None:
    """A blocking read waits at most half the socket timeout; the client has the configured
    timeouts and no retries of its own; an entry keeps every field; a subscription "from now" on
    an empty stream starts at its beginning; the head is the last entry's seq."""
    slow = RedisStreamBus(redis_url, "test:fh:unused", block_ms=5000, timeouts=RedisTimeouts(socket=2.5))
    tiny = RedisStreamBus(redis_url, "test:fh:unused", block_ms=0)
    try:
        assert (slow.block_ms, tiny.block_ms) == (1250, 1)
        kwargs = slow.redis.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"]) == \
            (2.5, 2.0, 30.0)
        assert kwargs["retry"].get_retries() == 0
    finally:
        await slow.close()
        await tiny.close()
    assert await redis_bus.head() is None
    live = redis_bus.subscribe()  # the stream is empty: "now" is its beginning
    first = asyncio.create_task(live.next_batch())
    await until(lambda: live._last_id == "0-0", "the position at the stream's beginning")
    when = 1767225600.123456
    events = [SequencedEvent(7, "did:plc:x", "#identity", when, b"\x00frame"), ev(9)]
    await redis_bus.publish(events)
    got = await asyncio.wait_for(first, 5)
    if len(got) == 1:
        got += await asyncio.wait_for(live.next_batch(), 5)
    assert [(e.seq, e.did, e.kind, e.time, e.frame, e.extra) for e in got] == [
        (7, "did:plc:x", "#identity", when, b"\x00frame", {}),
        (9, "did:plc:x", "#commit", events[1].time, commit_frame(9), {"prev_seq": 7})]
    assert await redis_bus.head() == 9
    await live.close()
    with pytest.raises(BusClosed):
        await live.next_batch()


async def test_redis_entries_chain_across_publishes_and_an_entry_without_prev_is_read(redis_bus: RedisStreamBus) -> None:
    """``prev`` carries on from the previous ``publish`` call of this publisher; an entry without a
    ``prev`` field (another writer's) is read with no ``prev_seq``."""
    sub = redis_bus.subscribe(after_seq=0)
    await redis_bus.publish([ev(1)])
    await redis_bus.publish([ev(2), ev(3)])
    await redis_bus.redis.xadd(redis_bus.stream, {"seq": "4", "did": "did:plc:y", "kind": "#account",
                                                  "time": "1.5", "frame": b"raw"}, id="4-0")
    got: list[SequencedEvent] = []
    while len(got) < 4:
        got += await asyncio.wait_for(sub.next_batch(), 5)
    assert [(e.seq, e.extra) for e in got] == [(1, {}), (2, {"prev_seq": 1}), (3, {"prev_seq": 2}), (4, {})]
    assert (got[3].did, got[3].kind, got[3].time, got[3].frame) == ("did:plc:y", "#account", 1.5, b"raw")
    await sub.close()


async def test_a_redis_subscription_from_now_skips_what_the_stream_holds(redis_bus: RedisStreamBus) -> None:
    await redis_bus.publish([ev(1), ev(2)])
    live = redis_bus.subscribe()  # "now" is after seq 2, not the stream's beginning
    first = asyncio.create_task(live.next_batch())
    await until(lambda: live._last_id is not None, "the subscription's position taken")
    assert live._last_id == "2-0"
    await redis_bus.publish([ev(3)])
    assert [e.seq for e in await asyncio.wait_for(first, 5)] == [3]
    await live.close()


async def test_redis_clients_take_the_timeouts_and_decoding_asked_for(redis_url: str) -> None:
    """The timeouts given (not the defaults); ``decode_responses`` as asked; a bus trims its stream
    approximately (whole nodes) unless told to trim exactly."""
    asked = RedisTimeouts(connect=1.5, socket=3.0, health_check=10.0)
    for client, decoded, timeouts in ((redis_client(redis_url, asked, decode_responses=True), True, (3.0, 1.5, 10.0)),
                                      (redis_client(redis_url), False, (2.0, 2.0, 30.0))):
        try:
            kwargs = client.connection_pool.connection_kwargs
            assert kwargs["decode_responses"] is decoded
            assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"]) == \
                timeouts
        finally:
            await client.aclose()
    for approximate in (None, True, False):  # None: the default, approximate
        stream = f"test:fh:{uuid.uuid4().hex}"
        bus = (RedisStreamBus(redis_url, stream, maxlen=5) if approximate is None
               else RedisStreamBus(redis_url, stream, maxlen=5, approximate_trim=approximate))
        try:
            await bus.publish([ev(seq) for seq in range(1, 301)])
            length = await bus.redis.xlen(stream)
            assert (length == 5) if approximate is False else (length > 5)
            assert await bus.head() == 300
        finally:
            await bus.redis.delete(stream)
            await bus.close()


async def test_an_in_process_subscription_holds_1024_batches_by_default() -> None:
    """The relay's in-process bus: a subscription holds 1024 unread batches, then ``publish`` waits."""
    bus = InProcessBus()
    sub = bus.subscribe()
    for seq in range(1, 1025):
        await bus.publish([ev(seq)])
    blocked = asyncio.create_task(bus.publish([ev(1025)]))
    await until(lambda: bool(getattr(sub._queue, "_putters", None)) or blocked.done(), "publish waiting for room")
    assert not blocked.done()
    assert [e.seq for e in await sub.next_batch()] == [1]
    await asyncio.wait_for(blocked, 5)
    await bus.close()



async def _xread_state(probe: Any, client_id: int) -> dict[str, Any] | None:
    """Redis's entry for connection ``client_id`` once its last command is an ``XREAD``. Redis runs
    one command at a time, so such a connection has either finished its read or is blocked in it
    (flag ``b``)."""
    for c in await probe.client_list():
        if int(c["id"]) == client_id and c.get("cmd") == "xread":
            return dict(c)
    return None


async def test_a_redis_subscription_reads_a_backlog_read_count_entries_at_a_time(
        redis_bus: RedisStreamBus, redis_url: str) -> None:
    """A backlog larger than one read comes in reads of ``read_count`` entries: 512 by default."""
    await redis_bus.publish([ev(seq) for seq in range(1, 601)])
    sub = redis_bus.subscribe(after_seq=0)
    assert [e.seq for e in await asyncio.wait_for(sub.next_batch(), 5)] == list(range(1, 513))
    assert [e.seq for e in await asyncio.wait_for(sub.next_batch(), 5)] == list(range(513, 601))
    await sub.close()
    three = RedisStreamBus(redis_url, redis_bus.stream, read_count=3)
    try:
        sub = three.subscribe(after_seq=595)
        assert [e.seq for e in await asyncio.wait_for(sub.next_batch(), 5)] == [596, 597, 598]
        assert [e.seq for e in await asyncio.wait_for(sub.next_batch(), 5)] == [599, 600]
        await sub.close()
    finally:
        await three.close()


@contextlib.asynccontextmanager
async def _watched_subscription(bus: RedisStreamBus, redis_url: str) -> AsyncIterator[
        tuple[asyncio.Task[list[SequencedEvent]], Any, int]]:
    """A subscription from seq 0 waiting for its next batch on ``bus``'s one pooled connection
    (whose ``CLIENT ID`` is given), and a second client to look at it with; the stream, the
    subscription and both clients are gone afterwards."""
    probe = redis_client(redis_url, decode_responses=True)
    try:
        client_id = await bus.redis.client_id()  # the bus's one pooled connection, which the reads use
        sub = bus.subscribe(after_seq=0)
        waiting = asyncio.create_task(sub.next_batch())
        yield waiting, probe, client_id
        await sub.close()
    finally:
        await bus.redis.delete(bus.stream)
        await probe.aclose()
        await bus.close()


async def test_a_redis_subscription_waits_blocked_in_its_read(redis_url: str) -> None:
    """On an idle stream a subscription waits inside a blocking ``XREAD`` (Redis lists it blocked),
    not in a loop of reads that return at once; a publish then wakes it."""
    bus = RedisStreamBus(redis_url, f"test:fh:{uuid.uuid4().hex}", block_ms=10_000,
                         timeouts=RedisTimeouts(socket=30.0))
    async with _watched_subscription(bus, redis_url) as (waiting, probe, client_id):
        reading: list[dict[str, Any]] = []

        async def a_read_listed() -> bool:
            state = await _xread_state(probe, client_id)
            reading[:] = [] if state is None else [state]
            return state is not None or waiting.done()

        await until_async(a_read_listed, "the subscription's XREAD", interval=0.01)
        assert not waiting.done()
        assert "b" in reading[0]["flags"], reading
        await bus.publish([ev(1)])
        assert [e.seq for e in await asyncio.wait_for(waiting, 5)] == [1]


async def test_a_redis_subscription_reads_again_after_an_empty_read(redis_url: str) -> None:
    """A blocking read that ends empty (its ``block_ms`` passed) is followed by another read: the
    subscription returns only when there are events."""
    bus = RedisStreamBus(redis_url, f"test:fh:{uuid.uuid4().hex}", block_ms=1)
    async with _watched_subscription(bus, redis_url) as (waiting, probe, client_id):

        async def an_empty_read_done() -> bool:  # listed, not blocked: a read of the empty stream ended
            state = await _xread_state(probe, client_id)
            return state is not None and "b" not in state["flags"]

        await until_async(an_empty_read_done, "an XREAD that ended empty", interval=0.01)
        await bus.publish([ev(1)])
        assert [e.seq for e in await asyncio.wait_for(waiting, 5)] == [1]


async def test_the_head_and_a_position_from_now_read_one_entry(redis_bus: RedisStreamBus) -> None:
    """``head()`` and a subscription "from now" ask Redis for the newest entry only (one entry in
    the reply), however long the stream is."""
    await redis_bus.publish([ev(seq) for seq in range(1, 4)])
    replies: list[int] = []
    xrevrange = redis_bus.redis.xrevrange

    async def logged_xrevrange(*args: Any, **kwargs: Any) -> Any:
        reply = await xrevrange(*args, **kwargs)
        replies.append(len(reply))
        return reply

    redis_bus.redis.xrevrange = logged_xrevrange
    assert await redis_bus.head() == 3
    live = redis_bus.subscribe()
    first = asyncio.create_task(live.next_batch())
    await until(lambda: live._last_id is not None, "the subscription's position taken")
    assert live._last_id == "3-0"
    assert replies == [1, 1]
    await redis_bus.publish([ev(4)])
    assert [e.seq for e in await asyncio.wait_for(first, 5)] == [4]
    await live.close()
