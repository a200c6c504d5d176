"""Following another relay: which accounts a relay upstream may speak for (both sides of the rule
in ARCHITECTURE.md "Relay upstreams"), and failover between two upstream relays.

Upstream relays are instances of this relay fed by the simulator; the downstream relay adds them
through the admin API as relays.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from backfill.types import HostState
from firehose.state import AccountState, PendingEvent, SequencedEvent
from firehose.subscriber import UpstreamFrame
from relay.ingest.admission import Admission
from relay.ingest.lanes import Work
from sim import SimConfig, SimFleet
from sim.ident import did_document
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
from tests.relay.helpers import RunningRelay, judge, lane_work, logged_frames, sequence
from tests.waiting import until

TOKEN = ADMIN_TOKEN


def _settings(fleet: SimFleet, **extra: object) -> dict[str, object]:
    return {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
            "default_account_limit": 1000, "admin_token": TOKEN, **extra}


def _admin(relay: RunningRelay) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=relay.url, headers={"authorization": f"Bearer {TOKEN}"})


@contextlib.asynccontextmanager
async def _fleet(config: SimConfig) -> AsyncIterator[SimFleet]:
    fleet = SimFleet(config)
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


async def _relay_upstreams(relay: RunningRelay, *hostnames: str) -> None:
    """Make ``hostnames`` known to ``relay`` as relay upstreams (never connected)."""
    for hostname in hostnames:
        await relay.service.store.upsert_host(HostState(hostname=hostname, relay=True))
    _admission(relay).host_changed()


def _admission(relay: RunningRelay) -> Admission:
    assert relay.service.lanes is not None
    return relay.service.lanes.admission


async def test_the_relay_rule_both_sides(relay_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Accepted: accounts whose DID document names a PDS this relay does not follow directly.
    Refused: a PDS followed directly (whatever its status), a banned domain, no PDS at all."""
    async with _fleet(SimConfig(hosts=2, accounts_per_host=2, seed=71)) as fleet:
        h0, h1 = fleet.hosts
        async with relay_factory(database_url=str(tmp_path / "up.sqlite"), **_settings(fleet)) as up, \
                relay_factory(database_url=str(tmp_path / "down.sqlite"), **_settings(fleet)) as down:
            await crawl(down.url, h1.hostname)
            await add_relay(down, up.url)
            relay_host = up.url.removeprefix("http://")
            admission = _admission(down)
            a0 = next(a for a in fleet.accounts if a.host is h0)
            a1 = next(a for a in fleet.accounts if a.host is h1)
            assert await admission.identity_for_host(a0.did, relay_host, relay=True) is not None
            assert await admission.identity_for_host(a1.did, relay_host, relay=True) is None  # followed directly
            assert await admission.identity_for_host(a1.did, h1.hostname) is not None  # its PDS still may
            # a PDS this relay follows directly keeps its binding even while it is blocked
            async with _admin(down) as http:
                assert (await http.post(f"/admin/hosts/{h1.hostname}/block")).status_code == 200
            assert await admission.identity_for_host(a1.did, relay_host, relay=True) is None
            # a domain ban covers a PDS this relay has never seen
            fleet.plc.docs[a0.did] = did_document(a0.did, a0.handle, a0.key, "https://pds.banned.example")
            await down.service.identity.purge(a0.did)
            assert await admission.identity_for_host(a0.did, relay_host, relay=True) is not None
            async with _admin(down) as http:
                assert (await http.post("/admin/domain-bans", json={"domain": "banned.example"})).status_code == 200
            admission.host_changed()  # (a ban on an unknown host applies within host_ttl otherwise)
            assert await admission.identity_for_host(a0.did, relay_host, relay=True) is None
            # an account carried by two relays stays bound to the one it came through first;
            # an event from its PDS rebinds it there
            other = "127.0.0.1:1"
            await down.service.store.upsert_host(HostState(hostname=other, relay=True, status="banned"))
            admission.host_changed()
            via_first = AccountState(did=a0.did, host=relay_host)
            assert (await admission.admit(other, a0.did, via_first)).host == relay_host  # type: ignore[union-attr]
            assert (await admission.admit(h0.hostname, a0.did, via_first)).host == h0.hostname  # type: ignore[union-attr]
            # a DID document that names no PDS
            doc = did_document(a0.did, a0.handle, a0.key, h0.url)
            doc["service"] = []
            fleet.plc.docs[a0.did] = doc
            await down.service.identity.purge(a0.did)
            assert await admission.identity_for_host(a0.did, relay_host, relay=True) is None


async def test_relay_upstream_carries_what_is_not_followed_directly(relay_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Over real sockets: host 0 reaches the downstream relay only through the upstream relay,
    host 1 both directly and through it. Every valid event arrives once; host 1's accounts stay
    bound to host 1 (the relay's copies are refused ``relay_not_authoritative``), host 0's are
    bound to the relay."""
    async with _fleet(SimConfig(hosts=2, accounts_per_host=3, seed=72)) as fleet:
        h0, h1 = fleet.hosts
        async with relay_factory(database_url=str(tmp_path / "up.sqlite"), **_settings(fleet)) as up, \
                relay_factory(database_url=str(tmp_path / "down.sqlite"), **_settings(fleet)) as down:
            for h in fleet.hosts:
                await crawl(up.url, h.hostname)
            async with Consumer(down.ws_url, cursor=0) as consumer:
                await crawl(down.url, h1.hostname)
                await add_relay(down, up.url)
                await fleet.generate(40)
                valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                await consumer.wait_for(lambda evs: len(evs) >= len(valid))
                latest = await settled(down, up.url)
                await down.service.upstreams.settle_read(h1.hostname)  # type: ignore[union-attr]
                latest = max(latest, await down.service.store.latest_seq())
                await consumer.wait_for(lambda evs: evs[-1].seq >= latest)
                async with _admin(down) as http:
                    bound = {a.did: (await http.get(f"/admin/accounts/{a.did}")).json()["host"]
                             for a in fleet.accounts}
                    text = (await http.get("/metrics")).text
    got = Counter(key_of(e.t, e.did, e.rev) for e in consumer.events)
    assert got == Counter(key_of(t.kind, t.did, t.rev) for t in valid)
    check_stream(consumer.events)
    relay_host = up.url.removeprefix("http://")
    assert {bound[a.did] for a in fleet.accounts if a.host is h1} == {h1.hostname}
    assert {bound[a.did] for a in fleet.accounts if a.host is h0} == {relay_host}
    assert metric_value(text, "relay_verdicts_total", kind="reject", reason="relay_not_authoritative") > 0


async def test_an_account_on_two_relays_reaches_the_sequencer_in_chain_order(relay_factory,  # type: ignore[no-untyped-def]
                                                                             tmp_path: Path) -> None:
    """Each host run hands the events its frames became to the sequencer itself. With one account
    carried by two relays, relay X's commit N can be accepted and still on its way to the sequencer
    when relay Y's copy of commit N+1 (chained on N) is judged; were N+1 accepted then, Y's run could
    store it first and N would be dropped as already sequenced — a hole in the account's chain (seen
    in the failover fault test under load). The lane judges N+1 only once X's events are settled.

    The test plays the two runs' drainers itself (frames from the simulator's log, fed to the lanes
    as the runs would), holding X's submission until Y's N+1 is either judged or waiting."""
    async with _fleet(SimConfig(hosts=1, accounts_per_host=1, seed=73)) as fleet:
        (host,) = fleet.hosts
        async with relay_factory(database_url=str(tmp_path / "down.sqlite"), **_settings(fleet)) as down:
            lanes, sequencer = down.service.lanes, down.service.sequencer
            assert lanes is not None and sequencer is not None
            x, y = "127.0.0.1:1", "127.0.0.1:2"
            await _relay_upstreams(down, x, y)
            await fleet.generate(6)
            frames = logged_frames(host)
            did = fleet.accounts[0].did
            commits = [f for f in frames if f.frame.t == "#commit" and f.frame.body.get("repo") == did]
            assert len(commits) >= 3
            first, n, n1 = commits[0], commits[1], commits[2]

            def work(hostname: str, uf: UpstreamFrame) -> Work:
                return lane_work(hostname, uf, did, relay=True)

            async def store(event: PendingEvent | None) -> SequencedEvent | None:
                return await sequence(down, event)

            # the account's first commit, through X (the #identity/#account frames are not needed)
            w0 = work(x, first)
            lanes.submit(w0)
            assert await store(await w0.judged) is not None
            # X's commit N: accepted, not yet handed to the sequencer
            wx = work(x, n)
            lanes.submit(wx)
            event_n = await wx.judged
            assert event_n is not None
            # Y's copies of N and N+1 arrive
            wy_n, wy_n1 = work(y, n), work(y, n1)
            lanes.submit(wy_n)
            lanes.submit(wy_n1)
            lane = lanes._lanes[did]
            await until(lambda: wy_n1.judged.done() or bool(lane.quiet), "Y's N+1 judged, or waiting for X's N")
            stored_n1: SequencedEvent | None = None
            if wy_n1.judged.done():  # (what happened before the fix) Y's run stores N+1 at once
                stored_n1 = await store(await wy_n1.judged)
            stored_n = await store(event_n)  # X's run hands N over
            if stored_n1 is None:
                assert await wy_n.judged is None  # Y's copy of N: a duplicate now
                stored_n1 = await store(await wy_n1.judged)
            assert stored_n is not None, "commit N was dropped as already sequenced: a hole before N+1"
            assert stored_n1 is not None and stored_n.seq < stored_n1.seq
            assert lanes.state(did) is not None and lanes.state(did).rev == n1.frame.body["rev"]  # type: ignore[union-attr]


async def test_an_identity_and_an_account_event_carried_by_two_relays_are_emitted_once(
        relay_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two relays carry the same host's stream: the account's ``#identity`` and ``#account`` come
    once through each. The first copy of each is accepted, the second is dropped (ignore
    ``duplicate_event``); a later, different ``#account`` through the second relay is accepted."""
    async with _fleet(SimConfig(hosts=1, accounts_per_host=1, seed=74)) as fleet:
        (host,) = fleet.hosts
        acct = fleet.accounts[0]
        async with relay_factory(database_url=str(tmp_path / "down.sqlite"), **_settings(fleet)) as down:
            x, y = "127.0.0.1:1", "127.0.0.1:2"
            await _relay_upstreams(down, x, y)
            fleet.set_status(acct, "deactivated")
            await fleet.generate(0)
            frames = logged_frames(host)
            identity, announced, deactivated = (f for f in frames if f.frame.t in ("#identity", "#account"))
            assert (identity.frame.t, announced.frame.t, deactivated.frame.t) == ("#identity", "#account", "#account")
            duplicates = down.service.metrics.verdicts.labels(kind="ignore", reason="duplicate_event")
            emitted = []
            for uf in (identity, announced):
                for relay_host in (x, y):
                    event = await judge(down, lane_work(relay_host, uf, acct.did, relay=True))
                    if event is not None:
                        emitted.append((relay_host, event.kind))
                        assert await sequence(down, event) is not None
            assert emitted == [(x, "#identity"), (x, "#account")]
            assert duplicates._value.get() == 2
            event = await judge(down, lane_work(y, deactivated, acct.did, relay=True))
            assert event is not None and event.kind == "#account" and event.body["active"] is False
            assert duplicates._value.get() == 2
