"""export against simulator hosts in real Spark local mode: rows equal the simulator's ground truth."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.testing import assertDataFrameEqual

from mst.cbor import encode
from mst.cid import cid_for_cbor, cid_str, parse_cid
from spark.db import connect_db
from spark.export import run_export
from spark.relaydb import AccountFilter
from tests.spark.helpers import FleetThread, job_config, seed_relay, tamper


def _from_json(value: Any) -> Any:
    """atproto JSON → data-model value (the inverse of ``spark.dagjson``)."""
    if isinstance(value, dict):
        if set(value) == {"$link"}:
            return parse_cid(value["$link"])
        if set(value) == {"$bytes"}:
            text = value["$bytes"]
            return base64.b64decode(text + "=" * (-len(text) % 4))
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def test_export_matches_ground_truth_and_is_repeatable(
    spark_session: Any, fleet: FleetThread, relay_db: str, tmp_path: Path
) -> None:
    seed_relay(relay_db, fleet)
    dropped, broken = fleet.fleet.accounts[5], fleet.fleet.accounts[6]
    fleet.call(tamper, broken)
    with connect_db(relay_db) as db:
        # the relay has sequenced 42 events before the export starts; one account is taken down
        db.execute("UPDATE relay_meta SET value = 42 WHERE key = 'seq_high_water'")
        db.execute("UPDATE accounts SET local_status = 'takendown' WHERE did = ?", dropped.did)
    truth = fleet.call(lambda: {
        (a.did, path.split("/")[0], path.split("/")[1], cid_str(cid), a.repo.rev)
        for a in fleet.fleet.accounts if a.did not in (dropped.did, broken.did)
        for path, cid in a.repo.records().items()
    })
    assert len(truth) >= 50

    out = tmp_path / "export"
    cfg = job_config(relay_db, fleet)
    manifest = run_export(spark_session, cfg, AccountFilter(), str(out))

    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["cursor"] == 42
    assert manifest["failed"] == {broken.did: "car_hash_mismatch"}  # unverifiable: not exported
    assert manifest["repositories_selected"] == 19
    assert manifest["records"] == len(truth)
    frame = spark_session.read.parquet(str(out / "records"))
    rows = frame.collect()
    assert {(r["did"], r["collection"], r["rkey"], r["cid"], r["rev"]) for r in rows} == truth
    assert len(rows) == len(truth)
    # every record's JSON is the exact record: re-encoded, it hashes to its CID
    for r in rows:
        assert cid_str(cid_for_cbor(encode(_from_json(json.loads(r["record"]))))) == r["cid"]
    by_collection = {}
    for r in rows:
        by_collection[r["collection"]] = by_collection.get(r["collection"], 0) + 1
    assert manifest["records_per_collection"] == by_collection
    partitions = sorted(p.name for p in (out / "records").iterdir() if p.name.startswith("collection="))
    assert partitions == sorted(f"collection={c}" for c in by_collection)

    # rerunning produces the same dataset
    again = run_export(spark_session, job_config(relay_db, fleet), AccountFilter(), str(out))
    assertDataFrameEqual(spark_session.read.parquet(str(out / "records")), rows)
    assert again["records"] == manifest["records"]

    # only chosen collections
    posts = tmp_path / "posts"
    only = run_export(spark_session, job_config(relay_db, fleet), AccountFilter(), str(posts),
                      collections=["app.bsky.feed.post"])
    want = {t for t in truth if t[1] == "app.bsky.feed.post"}
    got = spark_session.read.parquet(str(posts / "records")).collect()
    assert {(r["did"], r["collection"], r["rkey"], r["cid"], r["rev"]) for r in got} == want
    assert only["records_per_collection"] == {"app.bsky.feed.post": len(want)}


def test_failed_export_leaves_the_previous_dataset_in_place(
    spark_session: Any, fleet: FleetThread, relay_db: str, tmp_path: Path
) -> None:
    """A run that fails halfway (its executors cannot record their results: the table is gone)
    must not touch the dataset readers use: it only ever wrote its staging directory."""
    seed_relay(relay_db, fleet)
    out = tmp_path / "export"
    first = run_export(spark_session, job_config(relay_db, fleet), AccountFilter(), str(out))
    before = sorted(spark_session.read.parquet(str(out / "records")).collect())
    manifest = (out / "manifest.json").read_text()
    assert first["records"] == len(before) > 0
    with connect_db(relay_db) as db:
        db.execute("ALTER TABLE spark_job_results RENAME TO spark_job_results_away")
    try:
        with pytest.raises(Exception):  # noqa: B017 - Spark wraps the executor's error in its own types
            run_export(spark_session, job_config(relay_db, fleet), AccountFilter(), str(out))
    finally:
        with connect_db(relay_db) as db:
            db.execute("ALTER TABLE spark_job_results_away RENAME TO spark_job_results")
    assert sorted(spark_session.read.parquet(str(out / "records")).collect()) == before
    assert (out / "manifest.json").read_text() == manifest
