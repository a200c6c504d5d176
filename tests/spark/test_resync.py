"""resync against simulator hosts in real Spark local mode, and the relay side of its #sync."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from backfill.backends import open_store
from mst.car import read_car
from mst.cbor import decode, decode_prefix
from mst.cid import cid_str
from relay.cli import main as relay_main
from spark.db import connect_db
from spark.relaydb import AccountFilter, ResultRow, write_results
from spark.resync import run_resync
from tests.spark.helpers import FleetThread, account_state, apply_outbox, job_config, seed_relay, tamper


def _accounts(url: str) -> dict[str, dict[str, Any]]:
    with connect_db(url) as db:
        return {r["did"]: r for r in db.fetch(
            "SELECT did, host, upstream_status, rev, commit_cid, data_cid, sync_state FROM accounts")}


def _outbox(url: str) -> list[dict[str, Any]]:
    with connect_db(url) as db:
        return db.fetch("SELECT id, kind, did, rev, commit_cid, blocks, base_rev, observed_at, outcome "
                        "FROM spark_repair_outbox ORDER BY id")


def _results(url: str, run_id: str) -> dict[str, tuple[str, str | None]]:
    with connect_db(url) as db:
        rows = db.fetch("SELECT did, outcome, reason FROM spark_job_results WHERE run_id = ?", run_id)
    return {r["did"]: (r["outcome"], r["reason"]) for r in rows}


def _store_state(url: str, state: Any) -> None:
    async def put() -> None:
        store = await open_store(url)
        try:
            await store.upsert_account(state)
        finally:
            await store.close()

    asyncio.run(put())


def test_resync_verifies_detects_tampering_and_queues_repairs_the_relay_applies_with_cas(
    spark_session: Any, fleet: FleetThread, relay_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    accounts = fleet.fleet.accounts
    tampered, diverged, flagged, moved, overtaken = accounts[0], accounts[1], accounts[2], accounts[3], accounts[4]
    seed_relay(relay_db, fleet)
    fleet.call(tamper, tampered)
    # the DID document now names another PDS: the relay's host must not be trusted for this repo
    other = next(h for h in fleet.fleet.hosts if h is not moved.host)
    fleet.call(lambda: fleet.fleet.plc.docs[moved.did]["service"][0].__setitem__("serviceEndpoint", other.url))
    # the hosts moved on without the relay seeing it: the stored states are stale
    fleet.call(lambda: diverged.repo.apply_writes([]))
    fleet.call(lambda: overtaken.repo.apply_writes([]))
    # the relay's own validation flagged an account whose state is in fact right
    with connect_db(relay_db) as db:
        db.execute("UPDATE accounts SET sync_state = 'desynchronized' WHERE did = ?", flagged.did)
    before_job = _accounts(relay_db)

    cfg = job_config(relay_db, fleet)
    summary = run_resync(spark_session, cfg, AccountFilter())

    assert summary["totals"] == {"ok": 15, "queued": 3, "failed": 2}
    results = _results(relay_db, cfg.run_id)
    assert len(results) == 20
    assert results[tampered.did] == ("failed", "car_hash_mismatch")
    assert results[moved.did] == ("failed", "pds_mismatch")
    assert results[diverged.did] == ("queued", "state_diverged")
    assert results[overtaken.did] == ("queued", "state_diverged")
    assert results[flagged.did] == ("queued", "desync_cleared")
    with connect_db(relay_db) as db:
        sizes = db.fetch("SELECT did, records, bytes FROM spark_job_results WHERE run_id = ? AND outcome = 'ok'",
                         cfg.run_id)
    truth = fleet.call(lambda: {a.did: len(a.repo.records()) for a in accounts})
    assert all(r["records"] == truth[r["did"]] and r["bytes"] > 0 for r in sizes)

    # the job wrote no account state: the relay is the only writer
    assert _accounts(relay_db) == before_job
    outbox = _outbox(relay_db)
    assert sorted(r["did"] for r in outbox) == sorted([diverged.did, flagged.did, overtaken.did])
    assert all(r["kind"] == "#sync" and r["outcome"] is None and r["observed_at"] for r in outbox)
    head, rev, data = fleet.call(lambda: (cid_str(diverged.repo.head), diverged.repo.rev,
                                          cid_str(diverged.repo.data_root)))
    sync_row = next(r for r in outbox if r["did"] == diverged.did)
    assert sync_row["base_rev"] == before_job[diverged.did]["rev"]  # what the job saw
    car = read_car(bytes(sync_row["blocks"]))
    assert [cid_str(c) for c in car.roots] == [head] and len(car.blocks) == 1
    assert decode(bytes(next(iter(car.blocks.values()))))["rev"] == rev

    # meanwhile the live relay read the overtaken account's next two commits from its host
    fleet.call(lambda: overtaken.repo.apply_writes([]))
    _store_state(relay_db, fleet.call(account_state, overtaken))

    # what the relay did with them, as `relay spark repairs` tells it: nothing yet
    assert relay_main(["spark", "repairs", "--db", relay_db, "--run-id", cfg.run_id]) == 0
    assert capsys.readouterr().out == "relay, of 3 rows queued: pending=3\n"

    # the relay applies the outbox in the accounts' lanes: one durable #sync for the account it
    # really missed; the flag is cleared without an event; the overtaken repair is stale
    drained, events = asyncio.run(apply_outbox(relay_db, fleet.fleet.plc_url))
    assert (drained.consumed, drained.deferred) == (3, 0)
    assert [e.kind for e in events] == ["#sync"]
    header, used = decode_prefix(events[0].frame)
    assert header == {"op": 1, "t": "#sync"}
    body = decode(events[0].frame[used:])
    assert (body["did"], body["rev"], body["seq"]) == (diverged.did, rev, events[0].seq)
    assert bytes(body["blocks"]) == bytes(sync_row["blocks"])
    outcomes = {r["did"]: r["outcome"] for r in _outbox(relay_db)}
    assert outcomes == {diverged.did: "applied", flagged.did: "desync_cleared", overtaken.did: "stale"}
    assert relay_main(["spark", "repairs", "--db", relay_db, "--run-id", cfg.run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"applied": 1, "desync_cleared": 1, "stale": 1}
    assert relay_main(["spark", "repairs", "--db", relay_db, "--run-id", cfg.run_id]) == 0
    assert capsys.readouterr().out == "relay, of 3 rows queued: applied=1 desync_cleared=1 stale (discarded)=1\n"

    stored = _accounts(relay_db)
    assert (stored[diverged.did]["commit_cid"], stored[diverged.did]["rev"],
            stored[diverged.did]["data_cid"], stored[diverged.did]["sync_state"]) == (head, rev, data, "synced")
    assert stored[flagged.did]["sync_state"] == "synced"
    # the applied #sync installed the repository's record counts per collection with it
    with connect_db(relay_db) as db:
        counts = {r["collection"]: r["records"] for r in db.fetch(
            "SELECT collection, records FROM repo_collections WHERE did = ?", diverged.did)}
    paths = fleet.call(lambda: list(diverged.repo.records()))
    assert counts == dict(Counter(path.split("/")[0] for path in paths)) and counts
    assert stored[overtaken.did]["rev"] == fleet.call(lambda: overtaken.repo.rev)  # never rolled back
    assert stored[tampered.did]["sync_state"] == "synced"  # a bad download changes nothing
    assert asyncio.run(apply_outbox(relay_db, fleet.fleet.plc_url))[0].consumed == 0  # consumed once

    # a fresh run changes nothing: the applied accounts are ok now, nothing new is queued
    before_accounts, before_outbox = _accounts(relay_db), _outbox(relay_db)
    cfg2 = job_config(relay_db, fleet)
    again = run_resync(spark_session, cfg2, AccountFilter())
    assert again["totals"] == {"ok": 18, "failed": 2}
    assert _accounts(relay_db) == before_accounts
    assert _outbox(relay_db) == before_outbox

    # rerunning the same run id resumes it: every repository is finished, nothing is fetched
    resumed = run_resync(spark_session, cfg2, AccountFilter())
    assert resumed["selected_this_pass"] == 0 and resumed["this_pass"] == {}
    assert resumed["totals"] == again["totals"]


def test_resync_resumes_an_interrupted_run_and_filters_by_host(
    spark_session: Any, fleet: FleetThread, relay_db: str
) -> None:
    seed_relay(relay_db, fleet)
    host0 = fleet.fleet.hosts[0].hostname
    on_host0 = sorted(a.did for a in fleet.fleet.accounts if a.host.hostname == host0)
    cfg = job_config(relay_db, fleet)
    # an earlier attempt of this run finished three repositories before it was interrupted
    with connect_db(relay_db) as db:
        write_results(db, cfg.run_id, "resync", [ResultRow(d, host0, "ok") for d in on_host0[:3]])
    summary = run_resync(spark_session, cfg, AccountFilter(hosts=(host0,)))
    assert summary["selected_this_pass"] == len(on_host0) - 3
    assert summary["this_pass"] == {"ok": len(on_host0) - 3}
    assert summary["totals"] == {"ok": len(on_host0)}
    assert set(_results(relay_db, cfg.run_id)) == set(on_host0)
