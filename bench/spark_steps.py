"""CPU per record of each step of a Spark export/resync task, on one simulated repository, in
one process (no Spark, no HTTP): the profile behind the figures of ``bench/spark.py``.

    .venv/bin/python bench/spark_steps.py [--records 5000]

Prints ``| step | µs per record |`` rows (``time.process_time``, best of 7, inside
``spark.partitioning.quiet_gc`` as the tasks run).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from mst.car import read_car
    from mst.cbor import decode
    from mst.verify import verify_repo_car
    from sim.ident import SigningKey, TidClock, plc_did
    from sim.records import WriteMix
    from sim.repo import SimRepo
    from spark.dagjson import block_json
    from spark.export import _records
    from spark.partitioning import cid_strs, quiet_gc
    from spark.records_out import ParquetLayout, RecordWriter

    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=5000)
    n = parser.parse_args().records
    rng = random.Random(1)
    key = SigningKey.generate("k256", rng)
    did = plc_did(rng)
    repo = SimRepo(did, key, TidClock(clock_id=1))
    mix = WriteMix(rng, other_dids=[plc_did(rng) for _ in range(100)])
    repo.apply_writes([mix._create() for _ in range(n)])
    car = repo.export_car()

    def best(fn: Callable[[], Any]) -> float:
        fastest = float("inf")
        for _ in range(7):
            start = time.process_time()
            fn()
            fastest = min(fastest, time.process_time() - start)
        return fastest * 1e6 / n

    with quiet_gc(), tempfile.TemporaryDirectory() as scratch:
        v = verify_repo_car(car, did, None)
        paths = sorted(v.records)
        cids = [v.records[p] for p in paths]
        raws = [v.blocks[c] for c in cids]
        out = _records(v.records, v.blocks, None, "json")

        def write() -> None:
            writer = RecordWriter(Path(tempfile.mkdtemp(dir=scratch)), 0, 0, ParquetLayout())
            for collection, rkeys, strs, values in out:
                writer.add(collection, did, v.commit.rev, rkeys, strs, values)
            writer.close()

        rows = [
            ("CAR framing + SHA-256 of every block (read_car)", best(lambda: read_car(car))),
            ("verify_repo_car (read_car + commit + MST walk)", best(lambda: verify_repo_car(car, did, None))),
            ("record block look-ups (path -> CID -> bytes)", best(lambda: [v.blocks[v.records[p]] for p in paths])),
            ("strict DAG-CBOR decode (mst.cbor.decode)", best(lambda: [decode(r) for r in raws])),
            ("decode + JSON text (block_json)", best(lambda: [block_json(r) for r in raws])),
            ("CID strings (cid_strs)", best(lambda: cid_strs(cids))),
            ("export record step, JSON (_records)", best(lambda: _records(v.records, v.blocks, None, "json"))),
            ("export record step, dag-cbor (_records)", best(lambda: _records(v.records, v.blocks, None, "dag-cbor"))),
            ("RecordWriter + one zstd Parquet file per collection", best(write)),
        ]
    for name, micros in rows:
        print(f"| {name} | {micros:.2f} |")
    print(f"# {n} records, CAR {len(car)} bytes ({len(car) / n:.0f} B/record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
