"""reconcile against simulator hosts in real Spark local mode."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from mst.cbor import decode, decode_prefix
from spark.db import connect_db
from spark.reconcile import compare_entry, run_reconcile
from spark.repo_check import StoredAccount
from tests.spark.helpers import FleetThread, apply_outbox, job_config, seed_relay


def _snapshot(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with connect_db(url) as db:
        accounts = db.fetch("SELECT did, host, upstream_status, rev, commit_cid, sync_state FROM accounts ORDER BY did")
        outbox = db.fetch("SELECT kind, did, active, status FROM spark_repair_outbox ORDER BY id")
    return accounts, outbox


def test_reconcile_queues_findings_the_relay_applies_and_confirms_deleted_accounts(
        spark_session: Any, fleet: FleetThread, relay_db: str) -> None:
    accounts = fleet.fleet.accounts
    unknown, taken, moved_on, ghost_src, foreign, gone = (accounts[0], accounts[1], accounts[2], accounts[3],
                                                          accounts[4], accounts[5])
    seed_relay(relay_db, fleet, skip={unknown.did, foreign.did})
    # a host lists an account whose DID document names another PDS: it must not be adopted
    other = next(h for h in fleet.fleet.hosts if h is not foreign.host)
    fleet.call(lambda: fleet.fleet.plc.docs[foreign.did]["service"][0].__setitem__("serviceEndpoint", other.url))
    # the host takes an account down and another account commits, both unseen by the relay
    fleet.call(fleet.fleet.set_status, taken, "takendown")
    fleet.call(lambda: moved_on.repo.apply_writes([]))
    # the host deleted an account (it answers RepoNotFound; the DID still names the host)
    fleet.call(lambda: gone.host.accounts.pop(gone.did))
    # the relay believes in an account its host does not list and whose DID does not resolve
    ghost = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"
    with connect_db(relay_db) as db:
        db.execute(
            "INSERT INTO accounts (did, host, rev, commit_cid, data_cid) SELECT ?, host, rev, commit_cid, data_cid "
            "FROM accounts WHERE did = ?", ghost, ghost_src.did,
        )
    before_job = _snapshot(relay_db)[0]

    summary = run_reconcile(spark_session, job_config(relay_db, fleet))

    hosts = {h.hostname for h in fleet.fleet.hosts}
    assert set(summary["hosts"]) == hosts
    assert _totals(summary) == {"ok": 15, "added": 1, "not_added": 1, "status_diverged": 1, "head_diverged": 1,
                                "deleted": 2}
    assert summary["hosts"][ghost_src.host.hostname]["deleted"] >= 1

    with connect_db(relay_db) as db:
        outbox = db.fetch("SELECT kind, did, active, status, base_status, consumed_at FROM spark_repair_outbox")
        reasons = {r["did"]: (r["outcome"], r["reason"]) for r in db.fetch(
            "SELECT did, outcome, reason FROM spark_job_results WHERE run_id = ?", summary["run_id"])}
    assert _snapshot(relay_db)[0] == before_job  # the job wrote no account state
    assert sorted((r["kind"], r["did"], bool(r["active"]), r["status"]) for r in outbox) == sorted([
        ("add", unknown.did, True, None),
        ("#account", taken.did, False, "takendown"),
        ("desync", moved_on.did, True, None),
        ("#account", gone.did, False, "deleted"),
        ("#account", ghost, False, "deleted"),
    ])
    assert all(r["consumed_at"] is None for r in outbox)
    assert reasons[ghost] == ("deleted", "did_not_found")
    assert reasons[gone.did] == ("deleted", "repo_not_found")
    assert reasons[unknown.did] == ("added", "active")
    assert reasons[foreign.did] == ("not_added", "pds_mismatch")

    # the relay applies them in the accounts' lanes
    drained, events = asyncio.run(apply_outbox(relay_db, fleet.fleet.plc_url))
    assert (drained.consumed, drained.deferred) == (5, 0)
    bodies = sorted((e.did, e.kind, decode(e.frame[decode_prefix(e.frame)[1]:]).get("status")) for e in events)
    assert bodies == sorted([(taken.did, "#account", "takendown"), (gone.did, "#account", "deleted"),
                             (ghost, "#account", "deleted")])
    with connect_db(relay_db) as db:
        rows = {r["did"]: r for r in db.fetch("SELECT * FROM accounts")}
        applied = {r["did"]: r["outcome"] for r in db.fetch("SELECT did, outcome FROM spark_repair_outbox")}
    assert set(applied.values()) == {"applied"}
    assert rows[unknown.did]["host"] == unknown.host.hostname
    assert rows[unknown.did]["sync_state"] == "desynchronized"  # resync will fetch it
    assert rows[taken.did]["upstream_status"] == "takendown"
    assert rows[gone.did]["upstream_status"] == "deleted" and rows[ghost]["upstream_status"] == "deleted"
    assert rows[moved_on.did]["sync_state"] == "desynchronized"
    assert rows[moved_on.did]["rev"] != fleet.call(lambda: moved_on.repo.rev)  # state itself untouched
    assert foreign.did not in rows

    # a second pass queues nothing; a host that cannot be listed is reported, not fatal
    before = _snapshot(relay_db)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    again = run_reconcile(spark_session, job_config(relay_db, fleet), sorted(hosts) + [dead])
    assert _snapshot(relay_db) == before
    assert again["hosts"][dead] == {"host_failed:connect_error": 1}
    del again["hosts"][dead]
    # the added account has no state yet and the moved-on one is still behind: both stay flagged
    assert _totals(again) == {"ok": 16, "head_diverged": 2, "not_added": 1, "deleted": 2}


def _totals(summary: dict[str, Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for counts in summary["hosts"].values():
        for outcome, n in counts.items():
            totals[outcome] = totals.get(outcome, 0) + n
    return totals


def test_compare_entry_rejects_malformed_listing_entries() -> None:
    stored = StoredAccount("did:plc:aaaaaaaaaaaaaaaaaaaaaaaa", "h", "3kabcdefghij2", "bafyx", "bafyy", "synced")
    bad_head = {"did": stored.did, "head": "CID(bafy)", "rev": "3kabcdefghij2"}
    assert (compare_entry("h", bad_head, stored).outcome, compare_entry("h", bad_head, stored).reason) == (
        "invalid_entry", "bad_head")
    bad_rev = {"did": stored.did, "head": "bafyreib", "rev": "not-a-tid"}
    assert compare_entry("h", bad_rev, stored).reason == "bad_rev"
    assert compare_entry("h", {"did": "nope", "head": "bafyreib", "rev": "3kabcdefghij2"}, None).reason == "bad_did"


def _collections_view(url: str, collections: list[str]) -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
    """(did → stored counts, collection → listReposByCollection's DIDs) as the relay serves them."""
    from backfill.backends import open_store

    async def read() -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
        store = await open_store(url)
        try:
            dids = [a.did for a in await store.list_accounts(limit=1000)]
            counts = {did: await store.collection_counts(did) for did in dids}
            listed = {c: await store.list_repos_by_collection(c, None, 1000) for c in collections}
            return counts, listed
        finally:
            await store.close()

    return asyncio.run(read())


def _sequence_deltas(url: str, deltas: list[tuple[str, str, int, int]]) -> None:
    """What the sequencer writes for ops it saw (``(collection, did, delta, floor)``)."""
    from backfill.backends import open_store
    from backfill.store import BatchWrite

    async def write() -> None:
        store = await open_store(url)
        try:
            lease = await store.acquire_writer(wait=True, timeout=10)
            try:
                hw = await lease.high_water()
                await lease.commit_batch(BatchWrite(hw, hw, collection_deltas=deltas))
            finally:
                await lease.release()
        finally:
            await store.close()

    asyncio.run(write())


def test_one_reconcile_run_makes_list_repos_by_collection_equal_a_full_walk(
        spark_session: Any, fleet: FleetThread, relay_db: str) -> None:
    """The relay followed these accounts from mid-history: its counts are lower bounds (records
    older than the relay never counted; one account deleted a record the relay never saw; one
    holds a row for a collection it has emptied). One reconcile run walks every account whose
    counts are not exact and installs the truth: the listing then equals a full walk of every
    repository, 0 missing, 0 extra; a second run walks nothing."""
    from collections import Counter

    seed_relay(relay_db, fleet)
    accounts = fleet.fleet.accounts
    truth = fleet.call(lambda: {a.did: dict(Counter(p.partition("/")[0] for p in a.repo.records()))
                                for a in accounts})
    collections = sorted({c for counts in truth.values() for c in counts} | {"com.example.emptied"})
    first, second, third = accounts[0].did, accounts[1].did, accounts[2].did
    held = sorted(truth[second])[0]
    _sequence_deltas(relay_db, [
        (sorted(truth[first])[0], first, 1, 1),  # one create seen, the older records not
        (held, second, 1, 1), ("com.example.emptied", third, 2, 1),
    ])
    _sequence_deltas(relay_db, [(held, second, -2, 0)])  # deletes of records the relay never saw
    counts, listed = _collections_view(relay_db, collections)
    assert second in listed[held]  # a lower bound: never dropped while it may hold records
    assert any(counts[did] != truth[did] for did in truth)  # not the truth yet

    summary = run_reconcile(spark_session, job_config(relay_db, fleet))

    walked: dict[str, int] = {}
    for per_host in summary["collections"].values():
        for what, n in per_host.items():
            walked[what] = walked.get(what, 0) + n
    assert walked == {"counted": len(accounts)}
    counts, listed = _collections_view(relay_db, collections)
    assert counts == truth
    for collection in collections:
        assert listed[collection] == sorted(did for did, c in truth.items() if c.get(collection, 0) > 0), collection
    # exact from now on: a delete of the last record in a collection takes the account out of it
    only = next((did, c) for did, cs in truth.items() for c, n in cs.items() if n == 1)
    _sequence_deltas(relay_db, [(only[1], only[0], -1, 0)])
    assert only[0] not in _collections_view(relay_db, [only[1]])[1][only[1]]

    again = run_reconcile(spark_session, job_config(relay_db, fleet))
    assert all(per_host == {} for per_host in again["collections"].values())
