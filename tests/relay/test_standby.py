"""Hot standby: two ``relay ingest`` processes on one PostgreSQL schema.

The second one cannot take the writer lease, so it waits — with its HTTP port open, alive
(``/_health`` 200, ``state: standby``, naming the holder) and not ready (``/_ready`` 503
``standby``), as a Kubernetes pod must be to survive its liveness probe — and takes over when the
first is killed: same stream, no gap, no duplicate, the host followed on from its stored cursor.

The failover time is measured, from the moment the writer is sent SIGKILL to the first event the
standby stores (a row past the writer's last ``seq`` in the events table), and asserted below
``FAILOVER_BOUND``. What it is made of: PostgreSQL ends the dead writer's session (and with it the
advisory lock that is the writer lease) as soon as the kernel closes its socket; the standby tries
the lease every ``LEASE_POLL`` seconds; then it starts ingest (validation, host runs) and the host's
run connects from the stored cursor, reads what the host wrote meanwhile and the sequencer commits
it. The bound is many lease polls plus a generous start-up allowance for a loaded test machine:
the test guards against a takeover that waits on something (a timeout, a backoff), not against
jitter. The figure printed is the one README quotes.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import asyncpg
import httpx

from sim import SimConfig, SimFleet
from tests.faults.harness import RelayProcess
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, metric_value
from tests.relay.helpers import drop_schema_and_stream
from tests.waiting import until_async

#: How often a standby tries the writer lease (``backfill.postgres_store``: ``acquire_writer(wait=True)``).
LEASE_POLL = 0.2
#: Upper bound asserted on writer death → first event stored by the standby: 5 lease polls for the
#: takeover and 9 s for the standby's start of ingest and its first commit on a loaded machine.
FAILOVER_BOUND = 5 * LEASE_POLL + 9.0


async def _stored_seq(pg_dsn: str, schema: str) -> int:
    """The highest ``seq`` in the events table of ``schema`` (what is durably stored)."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        return int(await conn.fetchval(f'SELECT coalesce(max(seq), 0) FROM "{schema}".events'))
    finally:
        await conn.close()


async def _health(http: httpx.AsyncClient, url: str) -> dict[str, object]:
    resp = await http.get(url + "/_health")
    assert resp.status_code == 200, resp.text  # liveness never fails, whatever the phase
    body: dict[str, object] = resp.json()
    return body


async def test_standby_ingest_waits_healthy_then_takes_over(pg_dsn: str, redis_url: str, tmp_path: Path) -> None:
    schema = f"t_standby_{uuid.uuid4().hex[:12]}"
    stream = f"test:relay:{schema}"
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=17))
    await fleet.start()
    settings = {"RELAY_DATABASE_URL": f"{pg_dsn}?schema={schema}", "RELAY_REDIS_URL": redis_url,
                "RELAY_REDIS_STREAM": stream, "RELAY_ALLOW_INSECURE_HOSTS": "true",
                "RELAY_PLC_URL": fleet.plc_url, "RELAY_VALIDATION_WORKERS": "0"}
    try:
        async with RelayProcess("ingest", settings, tmp_path / "first.log") as first, \
                RelayProcess("ingest", settings, tmp_path / "second.log") as second, \
                httpx.AsyncClient(timeout=10) as http:
            await first.start()
            await crawl(first.url, fleet.hosts[0].hostname)
            await fleet.generate(15)
            before = [t for t in fleet.ground_truth if t.verdict == "accept"]
            async with Consumer(first.ws_url, cursor=0) as consumer:
                await consumer.wait_for(lambda evs: len(evs) >= len(before))

            await second.start(state="standby")
            assert first.server is not None
            health = await _health(http, second.url)
            assert health["role"] == "ingest" and health["state"] == "standby"
            assert f"pid {first.server.pid}" in str(health["waitingFor"]), health  # whom it waits for
            ready = await http.get(second.url + "/_ready")
            assert ready.status_code == 503
            assert ready.json()["status"] == "standby"
            assert ready.json()["reasons"][0].startswith("standby: waiting for the writer lease held by")
            # nothing but probes, metrics and dashboard before it runs
            refused = await http.get(second.url + "/xrpc/com.atproto.sync.listHosts")
            assert refused.status_code == 503 and refused.json()["error"] == "NotReady"
            metrics = (await http.get(second.url + "/metrics")).text
            assert metric_value(metrics, "relay_sequencer_state", state="waiting") == 1
            waiting = [line for line in second.log_path.read_text().splitlines()
                       if "waiting for the writer lease" in line]
            assert waiting and f"pid {first.server.pid}" in waiting[0], "the standby does not say whom it waits for"
            assert (await _health(http, first.url))["state"] == "running"

            written = await _stored_seq(pg_dsn, schema)
            fleet.prepare(15)  # written by the host while the writer dies: the standby must read them
            killed_at = time.monotonic()
            await first.kill9()
            await fleet.release()
            took_over_at: float | None = None

            async def stored_one() -> bool:
                nonlocal took_over_at
                if took_over_at is None and (await _health(http, second.url))["state"] == "running":
                    took_over_at = time.monotonic()
                return await _stored_seq(pg_dsn, schema) > written

            await until_async(stored_one, "the standby to store an event", timeout=60, interval=0.01)
            failover = time.monotonic() - killed_at
            assert took_over_at is not None
            print(f"standby failover: writer lease taken {took_over_at - killed_at:.2f} s, first event stored "
                  f"{failover:.2f} s after the writer's SIGKILL (bound {FAILOVER_BOUND:.1f} s)")
            assert failover < FAILOVER_BOUND, f"failover took {failover:.2f} s"
            assert (await http.get(second.url + "/_ready")).status_code == 200
            await fleet.generate(15)
            truth = [t for t in fleet.ground_truth if t.verdict == "accept"]
            assert len(truth) > len(before)
            async with Consumer(second.ws_url, cursor=0) as consumer:
                await consumer.wait_for(lambda evs: len(evs) >= len(truth))
            check_stream(consumer.events)
            assert [e.seq for e in consumer.events] == list(range(1, len(consumer.events) + 1))
            assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == \
                Counter(key_of(t.kind, t.did, t.rev) for t in truth)
    finally:
        await fleet.stop()
        await drop_schema_and_stream(pg_dsn, schema, redis_url, stream)
