"""Full-network export: records of chosen collections from verified repositories → Parquet.

``run_export(spark, cfg, flt, out_dir, collections=None, layout=None) -> dict`` (the manifest).

Before any repository is fetched the relay's current ``seq`` is read; it goes into
``<out_dir>/manifest.json`` as ``cursor``: an appview loads the dataset, then consumes
``subscribeRepos?cursor=<cursor>`` and sees every change made after the snapshot began (changes
already in the snapshot arrive again and are recognised by their ``rev``). Rows are
``(did, collection, rkey, cid, rev, record)`` with ``record`` the record as atproto JSON
(``$link``/``$bytes``) or, with ``layout.record_format="dag-cbor"``, its DAG-CBOR block; the
dataset is partitioned by ``collection`` and sorted by (did, rkey) within each file (layout and
the executors' pyarrow writing: ``spark.records_out``). It is written to a staging
directory beside it (``<out_dir>/.records-<run_id>.partial``) and only then put in place of
``<out_dir>/records`` in one step (``replace_dir``: an atomic exchange of the two directories), so
a reader sees the previous dataset or the new one, never a mix, and a run that fails leaves the
previous dataset as it was (and its staging directory, which the next run of the same id
clears first). The manifest lists every file with its size and SHA-256 (``files``), and
``repos``: ``records/_repos.parquet``, the exported repositories with the rev each was exported
at (also those with no record in the chosen collections), which a consumer going live from
``cursor`` deduplicates against (``firehose.bootstrap``). A rerun reproduces the same rows. ``manifest.json`` is replaced atomically too. Only repositories that pass full
verification are exported; the others are listed in the manifest with their reason and written
to ``spark_job_results``. Every exported repository's collection counts are rebuilt from it
(``spark.collections``: only while the relay still holds it at the exported rev).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mst.syntax import is_valid_nsid
from spark.collections import RepoCollections, collection_runs, rebuild_collections
from spark.config import JobConfig
from spark.dagjson import block_json
from spark.db import connect_db
from spark.fetch import HostFetcher
from spark.identity import IdentityClient
from spark.partitioning import (
    batched,
    by_host_shard,
    cid_strs,
    for_each_host,
    host_order,
    quiet_gc,
    read_accounts_rdd,
    work_partitions,
)
from spark.records_out import (
    REPOS_FILE,
    ParquetLayout,
    RecordWriter,
    TaskFiles,
    commit_task_files,
    describe_files,
    write_repos,
)
from spark.relaydb import AccountFilter, ResultRow, finish_run, relay_seq, start_run, write_results
from spark.repo_check import CheckError, StoredAccount, fetch_verified

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

JOB = "export"
RECORD_FIELDS = ("did", "collection", "rkey", "cid", "rev", "record")


@dataclass(slots=True)
class RepoRecords:
    """One verified repository's exported records, one entry per collection in path order:
    ``(collection, rkeys, cids, records)`` (rkeys ascending)."""

    did: str
    rev: str
    collections: list[tuple[str, list[str], list[str], list[Any]]]

    @property
    def count(self) -> int:
        return sum(len(rkeys) for _, rkeys, _, _ in self.collections)


def repo_rows(
    fetcher: HostFetcher, identities: IdentityClient, account: StoredAccount,
    collections: frozenset[str] | None, record_format: str = "json",
) -> tuple[ResultRow, RepoRecords | None, RepoCollections | None]:
    """Verified records of one repository, and its collection counts (never raises for bad
    input). Every exported record is decoded strictly (``mst.cbor``) in either format."""
    try:
        fetched = fetch_verified(fetcher, identities, account.did)
    except CheckError as exc:
        return ResultRow(account.did, account.host, "failed", exc.reason), None, None
    try:
        out = _records(fetched.records, fetched.blocks, collections, record_format)
    except Exception as exc:  # noqa: BLE001 - mst.errors.RepoError, a missing block, a bad path
        return ResultRow(account.did, account.host, "failed", getattr(exc, "reason", "record_invalid")), None, None
    repo = RepoRecords(account.did, fetched.rev, out)
    result = ResultRow(account.did, account.host, "ok", None, records=repo.count, bytes=fetched.size,
                       rev=fetched.rev)
    return result, repo, RepoCollections.of(account.did, fetched.rev, fetched.records)


def _records(
    records: dict[str, Any], blocks: Any, wanted: frozenset[str] | None, record_format: str,
) -> list[tuple[str, list[str], list[str], list[Any]]]:
    from mst.cbor import decode

    out: list[tuple[str, list[str], list[str], list[Any]]] = []
    paths = sorted(records)  # in MST order already: linear
    for collection, start, end in collection_runs(paths):
        run = paths[start:end]
        prefix = collection + "/"
        if wanted is not None and collection not in wanted:
            continue
        if not is_valid_nsid(collection) or not run[0].startswith(prefix):
            raise CheckError("invalid_repo_path", collection[:100])
        cids = [records[p] for p in run]
        raws = [blocks[c] for c in cids]
        values: list[Any]
        if record_format == "json":
            values = [block_json(raw) for raw in raws]
        else:
            for raw in raws:
                decode(raw)  # the same strictness as the JSON form; the bytes are exported as they are
            values = [bytes(raw) for raw in raws]
        out.append((collection, [p[len(prefix):] for p in run], cid_strs(cids), values))
    return out


def export_partition(
    cfg: JobConfig, collections: frozenset[str] | None, layout: ParquetLayout, staging: Path,
    accounts: Iterable[StoredAccount],
) -> Iterator[TaskFiles]:
    """Executor side: writes this task's Parquet files (``spark.records_out``) and yields their
    list; per-repository outcomes and collection counts go to the database as they complete."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    partition, attempt = (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (0, 0)
    writer = RecordWriter(staging, partition, attempt, layout)
    with quiet_gc():
        checked = for_each_host(cfg, accounts,
                                lambda f, i, a: repo_rows(f, i, a, collections, layout.record_format))
        with connect_db(cfg.db_url) as db:
            for batch in batched(checked, cfg.write_batch):
                for _, repo, _ in batch:
                    if repo is not None:
                        for collection, rkeys, cids, values in repo.collections:
                            writer.add(collection, repo.did, repo.rev, rkeys, cids, values)
                with db.transaction():
                    write_results(db, cfg.run_id, JOB, [result for result, _, _ in batch])
                    rebuild_collections(db, [counts for _, _, counts in batch if counts is not None])
        files = writer.close()
    yield files


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    C library or the filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return bool(done == 0)


def replace_dir(staging: Path, final: Path, *, exchange: bool = True) -> None:
    """Put the directory ``staging`` in place of ``final`` and remove what ``final`` held.

    ``final`` absent: one rename. Present: an atomic exchange of the two (readers of ``final`` see
    the old tree or the new one, never neither); where exchange is unavailable (or
    ``exchange=False``) the old tree is renamed aside first, leaving ``final`` missing for the
    moment between two renames, never half written."""
    if not final.exists():
        os.rename(staging, final)
        return
    if exchange and _exchange(staging, final):
        shutil.rmtree(staging)  # the previous dataset, now under the staging name
        return
    aside = final.with_name(f".{final.name}-old-{uuid.uuid4().hex[:8]}")
    os.rename(final, aside)
    os.rename(staging, final)
    shutil.rmtree(aside)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def run_export(
    spark: SparkSession, cfg: JobConfig, flt: AccountFilter, out_dir: str,
    collections: Iterable[str] | None = None, layout: ParquetLayout | None = None,
) -> dict[str, Any]:
    """Driver side; returns the manifest it wrote to ``<out_dir>/manifest.json``."""
    layout = layout or ParquetLayout()
    sc = spark.sparkContext
    parts = cfg.partitions or max(1, sc.defaultParallelism)
    wanted = frozenset(collections) if collections else None
    started = time.time()
    with connect_db(cfg.db_url) as db:
        cursor = relay_seq(db)  # read before any fetch: the gap-free resume point
        start_run(db, cfg.run_id, JOB, {"out": out_dir, "collections": sorted(wanted or [])})
    accounts, selected = read_accounts_rdd(sc, cfg, flt, parts)
    sc.setJobDescription(f"export {cfg.run_id}: {selected} repositories")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dataset = Path(out_dir) / "records"
    staging = Path(out_dir) / f".records-{cfg.run_id}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # what an earlier failed run of this id left
    staging.mkdir()
    results = (
        by_host_shard(accounts, cfg, work_partitions(parts, selected), host_order(cfg, flt))
        .mapPartitions(lambda it: export_partition(cfg, wanted, layout, staging, it))
        .collect()  # one small file list per task: the executors wrote the rows themselves
    )
    per_collection = commit_task_files(staging, results)
    with connect_db(cfg.db_url) as db:
        failed = {r["did"]: r["reason"] for r in db.fetch(
            "SELECT did, reason FROM spark_job_results WHERE run_id = ? AND outcome = 'failed'", cfg.run_id)}
        exported = [(r["did"], r["rev"]) for r in db.fetch(
            "SELECT did, rev FROM spark_job_results WHERE run_id = ? AND outcome = 'ok'", cfg.run_id)]
    write_repos(staging / REPOS_FILE, exported)
    files = describe_files(staging, "records")
    replace_dir(staging, dataset)
    manifest = {
        "format": "atproto-relay-export/1",
        "job": JOB,
        "run_id": cfg.run_id,
        "cursor": cursor,
        "started_at": started,
        "finished_at": time.time(),
        "collections": sorted(wanted) if wanted else None,
        "dataset": "records",
        "partitioned_by": ["collection"],
        "columns": list(RECORD_FIELDS),
        "record_format": layout.record_format,
        "sorted_by": ["did", "rkey"],
        "row_group_bytes": layout.row_group_bytes,
        "repositories_selected": selected,
        "repositories_exported": selected - len(failed),
        "records": sum(per_collection.values()),
        "records_per_collection": dict(sorted(per_collection.items())),
        "failed": dict(sorted(failed.items())),
        # every file with its size and SHA-256 (paths relative to the manifest's directory);
        # ``repos``: the exported repositories and the rev each was exported at
        "files": [f for f in files if f["path"] != f"records/{REPOS_FILE}"],
        "repos": next(f for f in files if f["path"] == f"records/{REPOS_FILE}"),
    }
    _write_atomically(Path(out_dir) / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with connect_db(cfg.db_url) as db:
        finish_run(db, cfg.run_id, {k: v for k, v in manifest.items() if k != "failed"} | {"failed": len(failed)})
    return manifest
