"""reconcile against simulator hosts in real Spark local mode."""

from __future__ import annotations

import socket
from typing import Any

from spark.db import connect_db
from spark.reconcile import compare_entry, run_reconcile
from spark.repo_check import StoredAccount
from tests.spark.helpers import FleetThread, job_config, seed_relay


def _snapshot(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with connect_db(url) as db:
        accounts = db.fetch("SELECT did, host, upstream_status, rev, commit_cid, sync_state FROM accounts ORDER BY did")
        outbox = db.fetch("SELECT kind, did, active, status FROM spark_repair_outbox ORDER BY id")
    return accounts, outbox


def test_reconcile_finds_status_head_and_unknown_divergences(spark_session: Any, fleet: FleetThread,
                                                             relay_db: str) -> None:
    accounts = fleet.fleet.accounts
    unknown, taken, moved_on, ghost_src, foreign = accounts[0], accounts[1], accounts[2], accounts[3], accounts[4]
    seed_relay(relay_db, fleet, skip={unknown.did, foreign.did})
    # a host lists an account whose DID document names another PDS: it must not be adopted
    other = next(h for h in fleet.fleet.hosts if h is not foreign.host)
    fleet.call(lambda: fleet.fleet.plc.docs[foreign.did]["service"][0].__setitem__("serviceEndpoint", other.url))
    # the host takes an account down and another account commits, both unseen by the relay
    fleet.call(fleet.fleet.set_status, taken, "takendown")
    fleet.call(lambda: moved_on.repo.apply_writes([]))
    # the relay believes in an account its host does not list
    ghost = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"
    with connect_db(relay_db) as db:
        db.execute(
            "INSERT INTO accounts (did, host, rev, commit_cid, data_cid) SELECT ?, host, rev, commit_cid, data_cid "
            "FROM accounts WHERE did = ?", ghost, ghost_src.did,
        )

    summary = run_reconcile(spark_session, job_config(relay_db, fleet))

    hosts = {h.hostname for h in fleet.fleet.hosts}
    assert set(summary["hosts"]) == hosts
    totals: dict[str, int] = {}
    for counts in summary["hosts"].values():
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
    assert totals == {"ok": 16, "added": 1, "not_added": 1, "status_diverged": 1, "head_diverged": 1,
                      "missing_on_host": 1}
    assert summary["hosts"][ghost_src.host.hostname]["missing_on_host"] == 1

    with connect_db(relay_db) as db:
        rows = {r["did"]: r for r in db.fetch("SELECT * FROM accounts")}
        outbox = db.fetch("SELECT kind, did, active, status, consumed_at FROM spark_repair_outbox")
        results = {r["did"]: r["outcome"] for r in db.fetch(
            "SELECT did, outcome FROM spark_job_results WHERE run_id = ?", summary["run_id"])}
    assert rows[unknown.did]["host"] == unknown.host.hostname
    assert rows[unknown.did]["sync_state"] == "desynchronized"  # resync will fetch it
    assert rows[taken.did]["upstream_status"] == "takendown"
    assert rows[moved_on.did]["sync_state"] == "desynchronized"
    assert rows[moved_on.did]["rev"] != fleet.call(lambda: moved_on.repo.rev)  # state itself untouched
    assert outbox == [{"kind": "#account", "did": taken.did, "active": False, "status": "takendown",
                       "consumed_at": None}]
    assert results[ghost] == "missing_on_host"
    assert results[unknown.did] == "added"
    assert results[foreign.did] == "not_added" and foreign.did not in rows

    # a second pass changes nothing; a host that cannot be listed is reported, not fatal
    before = _snapshot(relay_db)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    again = run_reconcile(spark_session, job_config(relay_db, fleet), sorted(hosts) + [dead])
    assert _snapshot(relay_db) == before
    assert again["hosts"][dead] == {"host_failed:connect_error": 1}
    totals2: dict[str, int] = {}
    for host, counts in again["hosts"].items():
        if host == dead:
            continue
        for outcome, n in counts.items():
            totals2[outcome] = totals2.get(outcome, 0) + n
    # the added account has no state yet and the moved-on one is still behind: both stay flagged
    assert totals2 == {"ok": 17, "head_diverged": 2, "not_added": 1, "missing_on_host": 1}


def test_compare_entry_rejects_malformed_listing_entries() -> None:
    stored = StoredAccount("did:plc:aaaaaaaaaaaaaaaaaaaaaaaa", "h", "3kabcdefghij2", "bafyx", "bafyy", "synced")
    bad_head = {"did": stored.did, "head": "CID(bafy)", "rev": "3kabcdefghij2"}
    assert (compare_entry("h", bad_head, stored).outcome, compare_entry("h", bad_head, stored).reason) == (
        "invalid_entry", "bad_head")
    bad_rev = {"did": stored.did, "head": "bafyreib", "rev": "not-a-tid"}
    assert compare_entry("h", bad_rev, stored).reason == "bad_rev"
    assert compare_entry("h", {"did": "nope", "head": "bafyreib", "rev": "3kabcdefghij2"}, None).reason == "bad_did"
