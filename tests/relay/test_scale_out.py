"""Scale-out: one ingest process and a fan-out replica on PostgreSQL + Redis Streams."""

from __future__ import annotations

import uuid
from collections import Counter

import httpx

from firehose.bus import RedisStreamBus
from relay.config import RelayConfig
from relay.service import RelayService
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of
from tests.relay.helpers import drop_schema_and_stream, serve_asgi


async def test_ingest_and_fanout_roles(pg_dsn: str, redis_url: str) -> None:
    schema = f"t_relay_{uuid.uuid4().hex[:12]}"
    stream = f"test:relay:{schema}"
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=3, seed=21))
    await fleet.start()
    config = RelayConfig.from_values({
        "database_url": f"{pg_dsn}?schema={schema}", "redis_url": redis_url, "bind": "127.0.0.1:0",
        "allow_insecure_hosts": "true", "plc_url": fleet.plc_url, "validation_workers": "0",
        "admin_token": "tok", "bus_max_entries": "1000"})
    ingest = RelayService(config, role="ingest", bus_stream=stream)
    fanout = RelayService(config, role="fanout", bus_stream=stream)
    try:
        await ingest.start()
        await fanout.start()
        assert fanout.hosts is None and fanout.sequencer is None
        assert isinstance(ingest.bus, RedisStreamBus) and ingest.bus.maxlen == 1000  # RELAY_BUS_MAX_ENTRIES
        async with serve_asgi(ingest.build_app()) as ingest_url, serve_asgi(fanout.build_app()) as fanout_url:
            ws = fanout_url.replace("http://", "ws://") + "/xrpc/com.atproto.sync.subscribeRepos"
            async with Consumer(ws, cursor=0) as consumer:
                for host in fleet.hosts:
                    await crawl(ingest_url, host.hostname)
                await fleet.generate(30)
                valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                await consumer.wait_for(lambda evs: len(evs) >= len(valid))
            assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == \
                Counter(key_of(t.kind, t.did, t.rev) for t in valid)
            check_stream(consumer.events)
            async with httpx.AsyncClient(base_url=fanout_url) as http:
                r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": "x.example.com"})
                assert r.status_code == 501  # crawling is the ingest process's job
                hosts = (await http.get("/xrpc/com.atproto.sync.listHosts")).json()["hosts"]
                assert sorted(h["hostname"] for h in hosts) == sorted(h.hostname for h in fleet.hosts)
    finally:
        await fanout.stop()
        await ingest.stop()
        await fleet.stop()
        await drop_schema_and_stream(pg_dsn, schema, redis_url, stream)
