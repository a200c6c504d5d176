"""Two upstream relays for the same accounts, one killed mid-stream: nothing lost, nothing twice.

The simulator feeds two instances of this relay (child processes on SQLite); a downstream relay
follows both as relay upstreams (admin API, ``relay: true``). Both carry every event, so the
downstream relay gets each one twice: the second copy is dropped in the account's lane (commits
and ``#sync`` by rev, ``#identity``/``#account`` by their body), counted, never turned into a
``#sync`` or an error. The first upstream is SIGKILLed while the stream is flowing and restarted
later (it resumes its hosts by its own cursors; the downstream relay resumes it by its cursor).
A consumer of the downstream relay must see every valid event exactly once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx

from sim import SimConfig, SimFleet
from tests.faults.harness import RelayProcess
from tests.relay.e2e import (
    ADMIN_TOKEN,
    Consumer,
    add_relay,
    check_stream,
    crawl,
    key_of,
    metric_value,
    settled,
)
from tests.relay.helpers import running_relay
from tests.waiting import until_async


async def _caught_up(relay: RelayProcess, fleet: SimFleet) -> bool:
    """``relay`` has stored every host's stream up to the host's latest seq (all events are valid)."""
    async with httpx.AsyncClient(base_url=relay.url) as http:
        for host in fleet.hosts:
            r = await http.get("/xrpc/com.atproto.sync.getHostStatus", params={"hostname": host.hostname})
            if r.status_code != 200 or r.json().get("seq", 0) < host.published_seq:
                return False
    return True


def _upstream(fleet: SimFleet, workdir: Path, name: str) -> RelayProcess:
    settings = {"RELAY_DATABASE_URL": str(workdir / f"{name}.sqlite"), "RELAY_PLC_URL": fleet.plc_url,
                "RELAY_ALLOW_INSECURE_HOSTS": "true", "RELAY_VALIDATION_WORKERS": "0",
                "RELAY_DEFAULT_ACCOUNT_LIMIT": "1000", "RELAY_RESYNC_WORKERS": "1"}
    return RelayProcess("serve", settings, workdir / f"{name}.log")


async def test_failover_between_two_upstream_relays_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=5, seed=81))
    await fleet.start()
    try:
        async with _upstream(fleet, tmp_path, "r1") as r1, _upstream(fleet, tmp_path, "r2") as r2:
            await asyncio.gather(r1.start(), r2.start())
            for relay in (r1, r2):
                for host in fleet.hosts:
                    await crawl(relay.url, host.hostname)
            async with running_relay(database_url=str(tmp_path / "down.sqlite"), allow_insecure_hosts=True,
                                     plc_url=fleet.plc_url, validation_workers=0, admin_token=ADMIN_TOKEN) as down:
                async with Consumer(down.ws_url, cursor=0) as consumer:
                    await add_relay(down, r1.url)
                    await add_relay(down, r2.url)
                    await fleet.generate(30)
                    valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                    await consumer.wait_for(lambda evs: len(evs) >= len(valid), timeout=60)

                    # kill the first upstream relay while the stream flows
                    fleet.prepare(120)
                    release = asyncio.create_task(fleet.release(rate=200))
                    mark = len(consumer.events)
                    await consumer.wait_for(lambda evs: len(evs) >= mark + 20, timeout=60)
                    await r1.kill9()
                    await release
                    valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                    await consumer.wait_for(lambda evs: len(evs) >= len(valid), timeout=60)

                    # bring it back: it catches up, and the downstream relay resumes it by its cursor
                    await r1.start()
                    await fleet.generate(30)
                    valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                    await consumer.wait_for(lambda evs: len(evs) >= len(valid), timeout=60)
                    for relay in (r1, r2):  # both upstreams (r1 after its restart) caught up with the hosts
                        await until_async(lambda relay=relay: _caught_up(relay, fleet),  # type: ignore[misc]
                                          f"{relay.url} to catch up with the hosts", timeout=60)
                    latest = max([await settled(down, r.url) for r in (r1, r2)])
                    await consumer.wait_for(lambda evs: evs[-1].seq >= latest)
                    async with httpx.AsyncClient() as http:
                        text = (await http.get(f"{down.url}/metrics")).text
    finally:
        await fleet.stop()
    got = Counter(key_of(e.t, e.did, e.rev) for e in consumer.events)
    want = Counter(key_of(t.kind, t.did, t.rev) for t in valid)
    lost, twice = want - got, got - want
    assert not lost and not twice, (lost, twice)
    check_stream(consumer.events)
    assert not [e for e in consumer.events if e.t == "#sync"]  # no duplicate became a resync
    # the second copies were dropped and counted (commits by rev, #identity/#account by body)
    # each second copy was dropped and counted as an ignore (commits and #sync by rev,
    # #identity/#account by their body), never a reject, a desync or an event
    # (kind "host" counts the upstream connections themselves: the killed relay's dropped socket)
    verdicts = {line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("relay_verdicts_total{")}
    assert {v.split('kind="')[1].split('"')[0] for v in verdicts} - {"host"} == {"accept", "ignore"}
    assert metric_value(text, "relay_verdicts_total", kind="ignore") >= len(valid)
