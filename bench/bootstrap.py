"""Bootstrap throughput from the snapshot, on one core: records per second that
``firehose.bootstrap`` reads from an export (size and SHA-256 checks included), and that the
``relay bootstrap`` SQLite fold applies.

A synthetic export (records of the simulator's write mix, written with the export's own Parquet
writer, ``spark.records_out``, and described like ``spark.export`` does) is built first; Spark is
not needed. pyarrow is held to one thread.

    .venv/bin/python bench/bootstrap.py [--records 200000]

Prints ``RESULT bootstrap_read_records_per_s=…``, ``RESULT bootstrap_sqlite_records_per_s=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import result  # noqa: E402


def build_export(out: Path, records: int) -> int:
    """Write a synthetic export of about ``records`` records under ``out``; returns the count."""
    from mst.cbor import encode
    from mst.cid import cid_for_cbor, cid_str
    from sim.records import WriteMix
    from spark.dagjson import record_json
    from spark.records_out import ParquetLayout, RecordWriter, commit_task_files, describe_files, write_repos

    rng = random.Random(1)
    mix = WriteMix(rng)
    staging = out / "records"
    staging.mkdir(parents=True)
    writer = RecordWriter(staging, 0, 0, ParquetLayout())
    repos: list[tuple[str, str]] = []
    made = 0
    n = 0
    while made < records:
        did = f"did:plc:{n:024d}"
        rev = f"3l{n:011d}"
        by_collection: dict[str, list[tuple[str, str, str]]] = {}
        for _ in range(50):
            write = mix._create()
            value = write.record
            by_collection.setdefault(write.collection, []).append(
                (write.rkey, cid_str(cid_for_cbor(encode(value))), record_json(value)))
        for collection in sorted(by_collection):
            rows = sorted(by_collection[collection])
            writer.add(collection, did, rev, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
            made += len(rows)
        repos.append((did, rev))
        n += 1
    per_collection = commit_task_files(staging, [writer.close()])
    write_repos(staging / "_repos.parquet", repos)
    files = describe_files(staging, "records")
    manifest = {"format": "atproto-relay-export/1", "cursor": 0, "record_format": "json",
                "records": sum(per_collection.values()),
                "files": [f for f in files if not f["path"].endswith("_repos.parquet")],
                "repos": next(f for f in files if f["path"].endswith("_repos.parquet"))}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return int(manifest["records"])


async def read_snapshot(export: Path, index_path: Path | None) -> tuple[int, float]:
    from firehose.bootstrap import Bootstrap
    from relay.bootstrap_cli import SqliteIndex

    boot = Bootstrap(str(export), "http://127.0.0.1:9")
    index = SqliteIndex(str(index_path)) if index_path is not None else None
    t0 = time.process_time()
    boot.manifest = await boot.source.manifest()
    await boot._load_revs()
    rows = 0
    async for batch in boot.snapshot():
        rows += len(batch.changes)
        if index is not None:
            index.apply(batch)
    if index is not None:
        index.close()
    boot.source.close()
    return rows, time.process_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        total = build_export(export, args.records)
        rows, cpu = asyncio.run(read_snapshot(export, None))
        assert rows == total, (rows, total)
        result("bootstrap_snapshot_records", rows)
        result("bootstrap_read_records_per_s", rows / cpu)
        rows, cpu = asyncio.run(read_snapshot(export, Path(tmp) / "index.sqlite"))
        result("bootstrap_sqlite_records_per_s", rows / cpu)


if __name__ == "__main__":
    main()
