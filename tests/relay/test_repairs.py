"""Spark repairs applied beside a live relay (``backfill.outbox`` + ``AccountLanes.apply_repair`` +
``Upstreams.caught_up``): a job that ran while the relay was behind must never make the relay
drop valid upstream commits, and a commit the relay really missed is repaired with one ``#sync``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from backfill.backends import open_store
from mst.car import read_car, write_car
from mst.cid import cid_str
from sim import SimConfig, SimFleet
from spark.db import connect_db
from spark.relaydb import SyncRepair, queue_sync_repairs
from spark.repo_check import StoredAccount
from tests.relay.e2e import Consumer, check_stream, crawl
from tests.waiting import until, until_async


def sync_repair(acct: Any, base: StoredAccount, observed_at: float) -> SyncRepair:
    """What the resync job queues for ``acct`` after verifying its repository now."""
    head = acct.repo.head
    commit_block = bytes(read_car(acct.repo.export_car()).blocks[head])
    return SyncRepair(did=acct.did, host=acct.host.hostname, rev=acct.repo.rev, commit_cid=cid_str(head),
                      data_cid=cid_str(acct.repo.data_root), blocks=write_car([head], [(head, commit_block)]),
                      base=base, observed_at=observed_at)


def stored_account(url: str, did: str) -> StoredAccount:
    with connect_db(url) as db:
        row = db.fetch("SELECT did, host, rev, commit_cid, data_cid, sync_state, upstream_status "
                       "FROM accounts WHERE did = ?", did)[0]
    return StoredAccount(**row)


def outcomes(url: str) -> dict[str, str | None]:
    with connect_db(url) as db:
        return {r["did"]: r["outcome"] for r in db.fetch("SELECT did, outcome FROM spark_repair_outbox")}


async def test_a_job_run_while_the_relay_is_behind_never_costs_a_commit(relay_factory: Any, tmp_path: Path) -> None:
    """Two hosts, one account each. The relay stops; both accounts commit; the relay's cursor of
    host B is then moved past B's new commits (they are lost to the relay for good). A resync job
    verifies both repositories and queues two ``#sync`` repairs. The relay restarts while host A is
    unreachable: it holds both rows (A: not connected; B: not yet quiet for the settle time). Host
    A comes back; once the relay has caught up with each host, A's repair is stale (A's commits
    arrived as ``#commit``) and B's is applied (one ``#sync``: B's commits really were missed)."""
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=1, seed=5))
    await fleet.start()
    db = str(tmp_path / "relay.sqlite")
    settings = {"database_url": db, "allow_insecure_hosts": True, "plc_url": fleet.plc_url,
                "validation_workers": 0, "repair_interval": "1h", "repair_settle": "3s"}
    a, b = fleet.accounts
    host_a, host_b = a.host.hostname, b.host.hostname
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await crawl(relay.url, host_a)
            await crawl(relay.url, host_b)
            await fleet.generate(6)
            revs = (a.repo.rev, b.repo.rev)
            await consumer.wait_for(lambda evs: {(e.did, e.rev) for e in evs} >= {(a.did, revs[0]), (b.did, revs[1])})
            last_seq = consumer.events[-1].seq

        # the relay is down; both accounts move on
        while a.repo.rev == revs[0] or b.repo.rev == revs[1]:
            await fleet.generate(1)
            missed_a = sum(1 for t in fleet.ground_truth if t.did == a.did and t.kind == "#commit" and (t.rev or "") > revs[0])
        store = await open_store(db)
        try:
            await store.set_host_cursor(host_b, b.host.seq)  # B's new commits are never read
        finally:
            await store.close()
        port_a = int(host_a.rsplit(":", 1)[1])
        await a.host.stop()
        observed = time.time()
        with connect_db(db) as jobdb:
            queue_sync_repairs(jobdb, "job-1", [sync_repair(a, stored_account(db, a.did), observed),
                                                sync_repair(b, stored_account(db, b.did), observed)])

        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=last_seq) as consumer:
            first = await relay.service.apply_repairs()
            assert first is not None and (first.consumed, first.deferred) == (0, 2)  # not caught up yet
            await a.host.start(port=port_a)

            async def applied() -> bool:
                result = await relay.service.apply_repairs()
                return result is not None and result.deferred == 0

            await until_async(applied, "both repairs applied", timeout=60)
            assert outcomes(db) == {a.did: "stale", b.did: "applied"}
            await consumer.wait_for(lambda evs: any(e.t == "#sync" for e in evs))
            await consumer.wait_for(lambda evs: a.repo.rev in {e.rev for e in evs if e.did == a.did})

            events = consumer.events
            check_stream(events)
            a_commits = [e for e in events if e.did == a.did and e.t == "#commit"]
            assert len(a_commits) == missed_a  # every commit of A arrived as a commit
            assert not any(e.t == "#sync" and e.did == a.did for e in events)
            b_events = [(e.t, e.rev) for e in events if e.did == b.did]
            assert b_events == [("#sync", b.repo.rev)]  # B's missed commits: one #sync at the host's rev
            for acct in (a, b):
                state = await relay.service.store.get_account(acct.did)
                assert state is not None
                assert (state.rev, state.commit_cid, state.sync_state) == (
                    acct.repo.rev, cid_str(acct.repo.head), "synced")
    finally:
        await fleet.stop()


async def test_repairs_wait_while_the_host_is_unreachable(relay_factory: Any, tmp_path: Path) -> None:
    """A row for a followed host the relay cannot reach stays pending (counted as deferred): the
    relay cannot know what the host sent meanwhile."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=6))
    await fleet.start()
    db = str(tmp_path / "relay.sqlite")
    settings = {"database_url": db, "allow_insecure_hosts": True, "plc_url": fleet.plc_url,
                "validation_workers": 0, "repair_interval": "1h", "repair_settle": "0.2s"}
    (acct,) = fleet.accounts
    try:
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await crawl(relay.url, acct.host.hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: acct.repo.rev in {e.rev for e in evs})
            await acct.host.stop()
            upstreams = relay.service.upstreams
            assert upstreams is not None
            await until(lambda: not upstreams.connected(acct.host.hostname))
            observed, observed_mono = time.time(), time.monotonic()
            with connect_db(db) as jobdb:
                queue_sync_repairs(jobdb, "job-2", [sync_repair(acct, stored_account(db, acct.did), observed)])
            result = await relay.service.apply_repairs()
            assert result is not None and (result.consumed, result.deferred) == (0, 1)
            # Once the settle time has passed on both clocks the catch-up check reads, a connected
            # host that sent nothing since would count as caught up; an unreachable one still does not.
            await until(lambda: time.time() >= observed + 0.2 and time.monotonic() >= observed_mono + 0.2,
                        "the settle time passed")
            result = await relay.service.apply_repairs()
            assert result is not None and (result.consumed, result.deferred) == (0, 1)
            assert outcomes(db) == {acct.did: None}
    finally:
        await fleet.stop()
