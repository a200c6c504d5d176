"""The export's Parquet layout and its commit protocol (``spark.records_out``).

With real Spark local mode: the dataset is partitioned by collection, every file is sorted by
(did, rkey), row groups follow ``row_group_bytes``, both record formats hold the exact records,
and nothing a failed or earlier attempt wrote is ever part of the dataset. Without Spark: the
writer's own ordering and size rules, and the driver's commit of exactly the reported attempts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from mst.cbor import decode
from mst.cid import cid_for_cbor, cid_str
from spark.export import run_export
from spark.records_out import ROW_OVERHEAD, ParquetLayout, RecordWriter, commit_task_files
from spark.relaydb import AccountFilter
from tests.spark.helpers import FleetThread, job_config, seed_relay


@pytest.fixture
def big_fleet() -> Any:
    ft = FleetThread(hosts=2, accounts_per_host=6, seed=11, initial_records=40)
    try:
        yield ft
    finally:
        ft.stop()


def _files(dataset: Path) -> list[Path]:
    """The record files (``_repos.parquet``, skipped by dataset readers, lists the repositories)."""
    return sorted(p for p in dataset.rglob("*.parquet") if not p.name.startswith("_"))


def _check_layout(dataset: Path, layout: ParquetLayout) -> list[tuple[Any, ...]]:
    """Every file: in a ``collection=`` directory, sorted by (did, rkey), row groups of the
    layout's size; returns all rows as (did, collection, rkey, cid, rev, record)."""
    entries = sorted(p.name for p in dataset.iterdir() if p.name != "_repos.parquet")
    assert entries and all(name.startswith("collection=") for name in entries), entries
    rows: list[tuple[Any, ...]] = []
    several_groups = False
    for path in _files(dataset):
        collection = path.parent.name.removeprefix("collection=")
        assert path.parent.parent == dataset
        meta = pq.ParquetFile(path)
        several_groups |= meta.num_row_groups > 1
        table = meta.read()
        assert table.column_names == ["did", "rkey", "cid", "rev", "record"]
        keys = list(zip(table.column("did").to_pylist(), table.column("rkey").to_pylist(), strict=True))
        assert keys == sorted(keys), f"{path} is not sorted by (did, rkey)"
        start = 0
        records = [len(r.encode()) if isinstance(r, str) else len(r) for r in table.column("record").to_pylist()]
        for g in range(meta.num_row_groups):
            n = meta.metadata.row_group(g).num_rows
            size = sum(records[start:start + n]) + ROW_OVERHEAD * n
            start += n
            # a group is closed by the row that makes it reach row_group_bytes (a file's last may
            # be smaller)
            biggest = max(records[start - n:start]) + ROW_OVERHEAD
            assert size < layout.row_group_bytes + biggest, (path, g, size)
            assert g == meta.num_row_groups - 1 or size >= layout.row_group_bytes, (path, g, size)
        for did, rkey, cid, rev, record in zip(*(table.column(c).to_pylist() for c in table.column_names),
                                               strict=True):
            rows.append((did, collection, rkey, cid, rev, record))
    assert several_groups, "the small row_group_bytes should split some file into several groups"
    return rows


@pytest.mark.parametrize("record_format", ["json", "dag-cbor"])
def test_export_layout_is_partitioned_sorted_and_exact(
    spark_session: Any, big_fleet: FleetThread, relay_db: str, tmp_path: Path, record_format: str
) -> None:
    seed_relay(relay_db, big_fleet)
    blocks = big_fleet.call(lambda: {
        cid_str(cid): acct.repo._s.records[path][1]
        for acct in big_fleet.fleet.accounts for path, cid in acct.repo.records().items()
    })
    truth = big_fleet.call(lambda: {
        (a.did, path.split("/")[0], path.split("/")[1], cid_str(cid), a.repo.rev)
        for a in big_fleet.fleet.accounts for path, cid in a.repo.records().items()
    })
    cfg = job_config(relay_db, big_fleet)
    # one task takes both hosts, so its rows do not arrive in DID order and must be sorted
    cfg = type(cfg)(cfg.db_url, cfg.run_id, cfg.fetch, cfg.write_batch, partitions=1)
    out = tmp_path / "export"
    # what an earlier, failed run of the same id left in its staging directory: an attempt's
    # file, and one already committed there when that run failed
    staging = out / f".records-{cfg.run_id}.partial"
    for junk in (staging / "_attempts" / "00000-0-dead" / "collection=x.y.z", staging / "collection=x.y.z"):
        junk.mkdir(parents=True)
        (junk / "part-00000-0000.parquet").write_bytes(b"half written")
    layout = ParquetLayout(record_format=record_format, row_group_bytes=6_000, task_buffer_bytes=40_000)

    manifest = run_export(spark_session, cfg, AccountFilter(), str(out), layout=layout)

    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "records"]
    rows = _check_layout(out / "records", layout)
    assert {r[:5] for r in rows} == truth and len(rows) == len(truth)
    per_collection: dict[str, int] = {}
    for _did, collection, _rkey, cid, _rev, record in rows:
        per_collection[collection] = per_collection.get(collection, 0) + 1
        if record_format == "json":
            assert json.loads(record)["$type"] == collection  # the JSON text of the record
            assert record == json.dumps(json.loads(record), sort_keys=True, separators=(",", ":"),
                                        ensure_ascii=False)
        else:
            assert record == bytes(blocks[cid])  # the block itself: it hashes to the row's CID
            assert cid_str(cid_for_cbor(record)) == cid and decode(record)["$type"] == collection
    assert manifest["records_per_collection"] == per_collection
    assert manifest["record_format"] == record_format and manifest["sorted_by"] == ["did", "rkey"]
    # several files per collection (the task's buffer is small): names never collide
    assert len(_files(out / "records")) > len(per_collection)
    # Spark reads the collection back from the directory names and prunes by it
    frame = spark_session.read.parquet(str(out / "records"))
    likes = frame.where(frame.collection == "app.bsky.feed.like").select("did", "rkey").collect()
    assert sorted((r["did"], r["rkey"]) for r in likes) == sorted(
        (t[0], t[2]) for t in truth if t[1] == "app.bsky.feed.like")


def _writer(staging: Path, partition: int, attempt: int, **layout: Any) -> RecordWriter:
    return RecordWriter(staging, partition, attempt, ParquetLayout(**layout))


def test_writer_sorts_only_what_arrives_out_of_order_and_splits_by_buffer(tmp_path: Path) -> None:
    w = _writer(tmp_path, 3, 0, task_buffer_bytes=10 * (ROW_OVERHEAD + 10))
    w.add("app.bsky.feed.post", "did:plc:b", "r1", ["1", "2"], ["c1", "c2"], ['{"x":"0123"}'] * 2)
    w.add("app.bsky.feed.post", "did:plc:a", "r1", ["3"], ["c3"], ['{"x":"0123"}'])  # out of order
    w.add("app.bsky.feed.like", "did:plc:a", "r1", ["1"], ["c4"], ['{"x":"0123"}'])
    assert not w.files  # 4 rows: under the buffer
    done = w.close()
    assert done.partition == 3 and len(done.files) == 2
    posts = pq.read_table(w.root / "collection=app.bsky.feed.post" / "part-00003-0001.parquet")
    assert list(zip(posts.column("did").to_pylist(), posts.column("rkey").to_pylist(), strict=True)) == [
        ("did:plc:a", "3"), ("did:plc:b", "1"), ("did:plc:b", "2")]

    # past the task's buffer the largest collection becomes a file at once
    w = _writer(tmp_path, 4, 0, task_buffer_bytes=10 * (ROW_OVERHEAD + 10))
    w.add("app.bsky.feed.like", "did:plc:a", "r1", ["1"], ["c"], ["0123456789"])
    w.add("app.bsky.feed.post", "did:plc:a", "r1", [str(i) for i in range(10)], ["c"] * 10, ["0123456789"] * 10)
    assert [(f.collection, f.rows) for f in w.files] == [("app.bsky.feed.post", 10)]
    assert w.buffered == ROW_OVERHEAD + 10  # the like is still buffered

    with pytest.raises(ValueError):  # a collection becomes a directory name: NSIDs only
        w.add("../escape", "did:plc:a", "r1", ["1"], ["c"], ["x"])


def test_commit_takes_exactly_the_reported_attempts(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    rows = (["1", "2"], ["c1", "c2"], ["{}", "{}"])
    failed = _writer(staging, 0, 0)  # the first attempt of partition 0 wrote a file, then failed
    failed.add("app.bsky.feed.post", "did:plc:a", "r1", *rows)
    failed.close()
    retried = _writer(staging, 0, 1)
    retried.add("app.bsky.feed.post", "did:plc:a", "r1", *rows)
    other = _writer(staging, 1, 0)
    other.add("app.bsky.feed.post", "did:plc:b", "r1", *rows)
    other.add("app.bsky.graph.follow", "did:plc:b", "r1", *rows)
    reported = [other.close(), retried.close()]

    counts = commit_task_files(staging, reported)

    assert counts == {"app.bsky.feed.post": 4, "app.bsky.graph.follow": 2}
    found = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    assert found == ["collection=app.bsky.feed.post/part-00000-0000.parquet",
                     "collection=app.bsky.feed.post/part-00001-0000.parquet",
                     "collection=app.bsky.graph.follow/part-00001-0001.parquet"]
    assert pq.read_table(staging / found[0]).num_rows == 2  # the retried attempt's file, once
    with pytest.raises(ValueError):
        commit_task_files(staging, [retried.close(), retried.close()])
