"""Live account-status self-healing (``relay.status_heal``) against the simulator's "status drift"
fault: a host changes an account's status without an ``#account`` event. Every drift is healed
within one sweep of the configured pace with one ``#account`` carrying the host's status; accounts
that did not drift are not touched; a host that cannot answer changes nothing."""

from __future__ import annotations

import time
from typing import Any

from relay.status_heal import LAST_SWEEP_KEY, HealPace, StatusHealer
from relay.status_suspects import SuspectQueue
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, crawl, settle
from tests.waiting import until


def account_events(consumer: Consumer, after: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in consumer.events:
        if e.t == "#account" and e.seq > after:
            out.setdefault(e.did, []).append(e.body)
    return out


async def swept_just_now(relay: Any, hostname: str) -> None:
    """Record a full sweep of ``hostname`` now: the next one is a whole interval away."""
    await relay.service.store.set_setting(LAST_SWEEP_KEY + hostname, str(time.time()))


def healer_of(relay: Any) -> StatusHealer:
    healer = relay.service.healer
    assert healer is not None
    return healer


async def test_every_drift_is_healed_within_one_sweep_and_nothing_else_changes(relay_factory: Any) -> None:
    """Three hosts. The relay follows all three and has seen everything. Host C then goes away
    (it cannot answer). On A and B, three accounts drift silently: deactivated, taken down,
    deleted (the host forgets the repository). Within the next full sweep of each host, each
    drifted account gets exactly one ``#account`` with the host's status and the stored status
    follows; no other account gets any ``#account`` (C's accounts included), and C's failures are
    counted."""
    fleet = SimFleet(SimConfig(hosts=3, accounts_per_host=4, seed=11))
    await fleet.start()
    settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                "status_heal_interval": "2s", "status_heal_suspect_delay": "1s", "repair_settle": "0.2s"}
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            for host in fleet.hosts:
                await crawl(relay.url, host.hostname)
            await fleet.generate(20)
            await settle(fleet, consumer)
            healer = healer_of(relay)
            store = relay.service.store
            host_a, host_b, host_c = fleet.hosts
            await host_c.stop()
            before = {a.did: await store.get_account(a.did) for a in fleet.accounts}
            assert all(s is not None and s.upstream_status == "active" for s in before.values())
            mark = consumer.events[-1].seq
            on_a = [a for a in fleet.accounts if a.host is host_a]
            on_b = [a for a in fleet.accounts if a.host is host_b]
            drifts = {on_a[0].did: "deactivated", on_a[1].did: "deleted", on_b[0].did: "takendown"}
            for acct in fleet.accounts:
                if acct.did in drifts:
                    fleet.drift_status(acct, drifts[acct.did])
            sweeps = {h.hostname: healer.sweeps.get(h.hostname, 0) for h in (host_a, host_b)}
            # one sweep may have been under way at the drift: the next one starts after it
            await until(lambda: all(healer.sweeps.get(h, 0) >= n + 2 for h, n in sweeps.items()),
                        "two more sweeps of hosts A and B", timeout=30)

            async def healed() -> bool:
                for did, status in drifts.items():
                    state = await store.get_account(did)
                    if state is None or state.upstream_status != status:
                        return False
                return True

            assert await healed(), "a drift was not healed within one sweep"
            await until(lambda: set(account_events(consumer, mark)) >= set(drifts), "the #account events")
            events = account_events(consumer, mark)
            assert set(events) == set(drifts), "an account that did not drift got an #account"
            for did, status in drifts.items():
                assert [(b["active"], b.get("status")) for b in events[did]] == [(False, status)]
            for acct in fleet.accounts:
                if acct.did not in drifts:
                    assert await store.get_account(acct.did) == before[acct.did], "an account that did not drift changed"
            metrics = relay.service.metrics
            assert metrics.heal_repairs.labels("deactivated", "applied")._value.get() == 1
            assert metrics.heal_repairs.labels("takendown", "applied")._value.get() == 1
            assert metrics.heal_repairs.labels("deleted", "applied")._value.get() == 1
            assert sum(s.get() for s in [metrics.heal_host_failures.labels("unreachable")._value]) >= 1
            assert metrics.heal_checked.labels("list")._value.get() >= 8
    finally:
        await fleet.stop()


async def test_a_commit_for_an_account_held_inactive_gets_it_checked_soon(relay_factory: Any) -> None:
    """The full sweep is an hour away. An account is deactivated (with its ``#account``), then its
    host reactivates it silently and it commits: the relay ignores the commit (it holds the account
    inactive), takes it as a suspect and asks the host, which says active: one ``#account`` active."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=12))
    await fleet.start()
    settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                "status_heal_interval": "1h", "status_heal_suspect_delay": "1s", "repair_settle": "0.2s"}
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await swept_just_now(relay, fleet.hosts[0].hostname)
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(6)
            await settle(fleet, consumer)
            acct, other = fleet.accounts[0], fleet.accounts[1]
            fleet.set_status(acct, "deactivated")
            await fleet.generate(0)
            await consumer.wait_for(lambda evs: any(e.t == "#account" and e.did == acct.did
                                                    and e.body.get("active") is False for e in evs))
            mark = consumer.events[-1].seq
            fleet.drift_status(acct, "active")
            await fleet.markers([acct])  # a commit of the account the relay holds deactivated
            await consumer.wait_for(lambda evs: any(e.t == "#account" and e.did == acct.did and e.seq > mark
                                                    for e in evs), timeout=20)
            events = account_events(consumer, mark)
            assert list(events) == [acct.did]
            assert [b["active"] for b in events[acct.did]] == [True]
            state = await relay.service.store.get_account(acct.did)
            assert state is not None and state.upstream_status == "active"
            assert healer_of(relay).sweeps == {}, "healed by a sweep, not by the suspect check"
            assert relay.service.metrics.heal_checked.labels("status")._value.get() == 1
            assert other.status == "active"
    finally:
        await fleet.stop()


async def test_a_drift_while_the_relay_is_disconnected_is_healed_after_the_reconnect(relay_factory: Any) -> None:
    """The full sweep is an hour away. The host goes down; while the relay is disconnected the
    host takes an account down without an ``#account`` event; the host comes back. The reconnect
    makes the relay list the host again: one ``#account`` takendown."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=13))
    await fleet.start()
    settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                "status_heal_interval": "1h", "status_heal_suspect_delay": "1s", "repair_settle": "0.2s"}
    host = fleet.hosts[0]
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await swept_just_now(relay, host.hostname)
            await crawl(relay.url, host.hostname)
            await fleet.generate(6)
            await settle(fleet, consumer)
            healer = healer_of(relay)
            await until(lambda: healer.seen_connected.get(host.hostname) is True, "the healer to see the host")
            mark = consumer.events[-1].seq
            port = int(host.hostname.rsplit(":", 1)[1])
            await host.stop()
            await until(lambda: healer.seen_connected.get(host.hostname) is False, "the healer to see the gap")
            acct = fleet.accounts[2]
            fleet.drift_status(acct, "takendown")
            await host.start("127.0.0.1", port)
            await consumer.wait_for(lambda evs: any(e.t == "#account" and e.seq > mark for e in evs), timeout=30)
            events = account_events(consumer, mark)
            assert list(events) == [acct.did]
            assert [(b["active"], b.get("status")) for b in events[acct.did]] == [(False, "takendown")]
            await until(lambda: healer.sweeps.get(host.hostname) == 1, "the sweep the reconnect started to finish")
            assert relay.service.metrics.heal_repairs.labels("takendown", "applied")._value.get() == 1
    finally:
        await fleet.stop()


async def test_a_reconnect_between_two_passes_is_found_by_the_connection_count(relay_factory: Any) -> None:
    """The full sweep is an hour away. The host goes down and comes back between two passes of the
    healer, which therefore never sees it disconnected; a drift made during the gap is healed all
    the same, because the run's connection count went up: the next pass schedules a sweep
    ``settle`` later, which lists the host and heals the drift. Passes without a reconnect schedule
    nothing, not even after the re-sweep gap has gone by. (The healer is driven pass by pass on a
    clock of the test's: the relay's own healing is off.)"""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=14))
    await fleet.start()
    settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                "status_heal_interval": "0", "repair_settle": "0.2s"}
    host = fleet.hosts[0]
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service = relay.service
            assert service.healer is None
            upstreams = service.upstreams
            pace = HealPace(interval=3600.0, suspect_delay=1.0, timeout=5.0, settle=0.2)
            now = [time.time()]
            healer = StatusHealer(store=service.store, lanes=service.lanes, upstreams=upstreams, safe=service.safe,
                                  identity=service.identity, metrics=service.metrics, pace=pace,
                                  suspects=SuspectQueue(pace.suspect_delay), insecure=True, clock=lambda: now[0])
            await swept_just_now(relay, host.hostname)
            await crawl(relay.url, host.hostname)
            await fleet.generate(6)
            await settle(fleet, consumer)
            await until(lambda: upstreams.connected(host.hostname), "the relay to follow the host")
            await healer.step()
            assert healer.seen_connected.get(host.hostname) is True and healer.sweeps == {}
            connections = upstreams.connections(host.hostname)
            mark = consumer.events[-1].seq
            port = int(host.hostname.rsplit(":", 1)[1])
            await host.stop()
            await until(lambda: not upstreams.connected(host.hostname), "the relay to lose the host")
            acct = fleet.accounts[1]
            fleet.drift_status(acct, "takendown")
            await host.start("127.0.0.1", port)
            await until(lambda: upstreams.connected(host.hostname)
                        and upstreams.connections(host.hostname) > connections, "the relay to reconnect")
            assert healer.seen_connected[host.hostname] is True  # the gap fell between two passes
            await healer.step()  # the count went up: a sweep is due `settle` from now
            assert healer.sweeps == {}
            now[0] += pace.settle
            await healer.step()
            assert healer.sweeps == {host.hostname: 1}
            await consumer.wait_for(lambda evs: any(e.t == "#account" and e.seq > mark for e in evs), timeout=30)
            events = account_events(consumer, mark)
            assert list(events) == [acct.did]
            assert [(b["active"], b.get("status")) for b in events[acct.did]] == [(False, "takendown")]
            state = await service.store.get_account(acct.did)
            assert state is not None and state.upstream_status == "takendown"
            # no reconnect since: passes after the re-sweep gap still leave the host an interval away
            now[0] += pace.resweep_gap + pace.settle
            await healer.step()
            now[0] += pace.settle
            await healer.step()
            assert healer.sweeps == {host.hostname: 1}
    finally:
        await fleet.stop()
