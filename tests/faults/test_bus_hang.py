"""A hung Redis (its process stopped with SIGSTOP: connections open, nothing answered) costs the
fan-out latency, never durable ingest: the sequencer hands committed batches to the bus publisher
and goes on (``firehose.publisher``), every Redis call is bounded by ``RELAY_REDIS_TIMEOUT``, and
readiness names the cause (``bus_hung``). Nothing is lost and consumers get everything, in order,
once Redis answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.exceptions

from backfill.backends import open_store
from backfill.sequencer import Sequencer
from firehose.broadcast import Broadcaster
from firehose.bus import RedisStreamBus, RedisTimeouts, redis_client
from firehose.publisher import BusPublisher, batch_bytes
from firehose.state import PendingEvent, SequencedEvent
from relay.redis_guard import FailFastRedis, RedisSkipped
from sim import SimConfig, SimFleet
from tests.faults.harness import RedisServer
from tests.relay.e2e import Consumer, check_stream, crawl, metric_value
from tests.relay.helpers import running_relay
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

OFFERED_RATE = 30.0  # commits/s offered while Redis is stopped (the rate the issue measured at)
DURING_HANG = 60  # commits offered while Redis is stopped


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    await server.start()
    try:
        yield server
    finally:
        server.resume()
        await server.close()


async def test_a_hung_redis_does_not_slow_durable_ingest(redis_server: RedisServer, tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=6, seed=27))
    await fleet.start()
    settings: dict[str, Any] = {
        "database_url": str(tmp_path / "relay.sqlite"), "redis_url": redis_server.url,
        "allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
        "redis_timeout": "0.5s", "redis_connect_timeout": "0.5s", "bus_publish_timeout": "1s",
    }
    try:
        async with running_relay(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer, \
                httpx.AsyncClient(base_url=relay.url, timeout=10) as http:
            service = relay.service
            sequencer, publisher = service.sequencer, service.publisher
            assert sequencer is not None and publisher is not None
            assert service.core is not None
            for client in (service.core.redis, service.bus.redis):  # every Redis client is bounded
                kwargs = client.connection_pool.connection_kwargs
                assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.5, 0.5)
                assert kwargs["health_check_interval"] == 30.0
            await crawl(relay.url, fleet.hosts[0].hostname)
            warm = await fleet.generate(6)
            await consumer.wait_for(lambda evs: {t.rev for t in warm} <= {e.rev for e in evs})
            assert (await http.get("/_ready")).status_code == 200

            redis_server.pause()
            before = sequencer.stats.events
            fleet.prepare(DURING_HANG)
            truth = fleet.ground_truth[-DURING_HANG:]
            started = time.monotonic()
            offered_for = await fleet.release(OFFERED_RATE)
            # Ingest keeps the offered pace: when the last commit has been offered, at least 80 %
            # of them are durable (an identity lookup waiting on Redis per commit: ~25 %).
            kept_pace = sequencer.stats.events - before
            assert kept_pace >= 0.8 * DURING_HANG, f"only {kept_pace} of {DURING_HANG} durable as the offer ended"
            # and every one of them is durable while Redis is still stopped
            await until(lambda: sequencer.stats.events >= before + DURING_HANG,
                        "every commit offered during the hang to be sequenced", timeout=15)
            durable_after = time.monotonic() - started
            await until(lambda: publisher.failing is not None, "the publisher to see the hung bus", timeout=10)
            ready = await http.get("/_ready")
            assert ready.status_code == 503, ready.text
            assert any(r.startswith("bus_unavailable: bus_hung") for r in ready.json()["reasons"]), ready.text
            assert sequencer.state == "running"
            print(f"RESULT offered {DURING_HANG} commits in {offered_for:.1f} s, {kept_pace} durable then; all after "
                  f"{durable_after:.1f} s with Redis stopped ({DURING_HANG / durable_after:.1f}/s of "
                  f"{OFFERED_RATE:.0f}/s offered); publish errors {publisher.stats.errors}")

            redis_server.resume()
            revs = {t.rev for t in truth}
            await consumer.wait_for(lambda evs: revs <= {e.rev for e in evs}, timeout=30)
            await until(lambda: publisher.failing is None, "publishing to work again", timeout=10)
            check_stream(consumer.events)  # in order, no duplicate
            stored = await service.store.latest_seq()
            assert [e.seq for e in consumer.events] == list(range(1, (stored or 0) + 1))  # nothing lost
            assert (await http.get("/_ready")).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert metric_value(metrics, "relay_bus_publish_errors_total") >= 1
            assert metric_value(metrics, "relay_bus_publish_events_total", result="published") >= DURING_HANG
    finally:
        await fleet.stop()


def _event(n: int) -> PendingEvent:
    return PendingEvent("#identity", f"did:plc:hang{n}", {"did": f"did:plc:hang{n}", "time": "2026-01-01T00:00:00Z"})


async def test_sequencing_never_waits_for_the_bus(redis_server: RedisServer, tmp_path: Path) -> None:
    """Submitted one at a time (as an account's lane does), events become durable while the
    first publish of the hang is still waiting for Redis (a reply timeout far longer than the
    test): the sequencer hands batches to the publisher and never awaits the bus. After SIGCONT
    the publisher delivers every one of them to the stream, once."""
    store = await open_store(str(tmp_path / "seq.sqlite"))
    await store.migrate()
    bus = RedisStreamBus(redis_server.url, stream="hang", timeouts=RedisTimeouts(connect=1.0, socket=60.0))
    publisher = BusPublisher(bus, timeout=60.0)
    publisher.start()
    try:
        async with Sequencer(store, publisher.publish) as seq:
            await seq.submit(_event(0))
            await publisher.flushed()
            assert await bus.head() == 1
            redis_server.pause()

            async def one_at_a_time() -> None:
                for n in range(1, 21):
                    await seq.submit(_event(n))

            await asyncio.wait_for(one_at_a_time(), 20)  # an awaited publish: stuck on the first
            assert await store.latest_seq() == 21
            assert publisher.stats.published == 1 and publisher.stats.errors == 0  # the bus never answered
            assert seq.stats.publish_errors == 0
            redis_server.resume()
            await asyncio.wait_for(publisher.flushed(), 30)
            assert publisher.stats.published == 21 and publisher.stats.dropped == 0
            entries = await bus.redis.xrange("hang")
            assert [int(entry_id.split(b"-")[0]) for entry_id, _ in entries] == list(range(1, 22))
    finally:
        await publisher.close()
        await bus.close()
        await store.close()


async def test_a_full_publish_queue_drops_the_oldest_and_the_fan_out_fills_the_hole(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """With Redis stopped the publisher's queue stays within its byte budget (plus the newest
    batch): the oldest unpublished events are dropped and counted. After SIGCONT the stream lacks
    them, and a fan-out following it still delivers every event exactly once, in order, without
    passing the hole: it reads the missing ones from the store first."""
    store = await open_store(str(tmp_path / "drop.sqlite"))
    await store.migrate()
    slow = RedisTimeouts(connect=1.0, socket=60.0)
    bus = RedisStreamBus(redis_server.url, stream="drop", timeouts=slow)
    publisher = BusPublisher(bus, max_bytes=3000, timeout=60.0)  # room for ~10 small events
    follower_bus = RedisStreamBus(redis_server.url, stream="drop", timeouts=slow)
    broadcaster = Broadcaster(store, follower_bus)
    delivered: list[int] = []
    real_deliver = broadcaster.deliver

    def deliver(batch: list[SequencedEvent]) -> None:
        last = broadcaster.latest_seq
        delivered.extend(e.seq for e in batch if e.seq > last)
        real_deliver(batch)

    broadcaster.deliver = deliver  # type: ignore[method-assign]
    await broadcaster.start()
    publisher.start()
    try:
        async with Sequencer(store, publisher.publish) as seq:
            await seq.submit(_event(0))
            await publisher.flushed()
            redis_server.pause()
            for n in range(1, 41):
                event = await seq.submit(_event(n))
                assert event is not None
                assert publisher.stats.queued_bytes <= publisher.max_bytes + batch_bytes([event])
            assert publisher.stats.dropped > 0
            redis_server.resume()
            await asyncio.wait_for(publisher.flushed(), 30)
            await until(lambda: broadcaster.latest_seq >= 41, "the fan-out to deliver everything", timeout=30)
        entries = await bus.redis.xrange("drop")
        assert len(entries) == 41 - publisher.stats.dropped  # the hole was real on the bus
        assert delivered == list(range(1, 42))  # and no consumer saw it
        assert broadcaster.stats.bus_gaps_filled >= 1
    finally:
        await broadcaster.close()
        await publisher.close()
        await follower_bus.close()
        await bus.close()
        await store.close()


async def test_the_identity_cache_client_stops_asking_a_hung_redis(redis_server: RedisServer) -> None:
    """One call waits for the reply timeout; the calls after it fail at once until the cool-off
    has passed; then one probe goes out, and once Redis answers calls pass again."""
    now = [0.0]
    client = redis_client(redis_server.url, RedisTimeouts(connect=0.5, socket=0.5))
    guard = FailFastRedis(client, cool_off=2.0, clock=lambda: now[0])
    try:
        await guard.set("k", "v")
        redis_server.pause()
        with pytest.raises(redis.exceptions.TimeoutError):  # it asked, and waited for the reply timeout
            await guard.get("k")
        assert guard.open
        with pytest.raises(RedisSkipped):
            await asyncio.wait_for(guard.get("k"), 0.25)  # less than the reply timeout: not sent
        now[0] += 2.0
        redis_server.resume()
        assert await guard.get("k") == b"v"  # the probe after the cool-off
        assert not guard.open
    finally:
        redis_server.resume()
        await client.aclose()
