"""The export's Parquet files: written inside the executors with pyarrow, committed by the driver.

Layout — chosen for how an appview backfill reads the dataset: one collection at a time (it
fills one table per record type), each account's records together (it upserts per account):

* hive-partitioned by collection: ``collection=<nsid>/part-<task>-<n>.parquet``; a reader of one
  collection opens only that directory (Spark, pyarrow and DuckDB read ``collection`` back from
  the directory name);
* columns ``did, rkey, cid, rev, record``; ``record`` is the record as atproto JSON text
  (``record_format="json"``) or its DAG-CBOR block as bytes (``"dag-cbor"``, for readers that
  decode themselves; its hash is the row's ``cid``);
* inside a file rows are sorted by ``(did, rkey)``: an account's records are contiguous and the
  row groups' ``did`` statistics let a reader looking for a few accounts skip the others;
* row groups of about ``row_group_bytes`` of uncompressed data (default 64 MiB: long sequential
  reads, one group in memory per reader thread), zstd pages, dictionaries for ``did`` and ``rev``.

Commit protocol (nothing half written is ever visible): a task attempt writes only into its own
directory ``<staging>/_attempts/<partition>-<attempt>-<random>/``, each file under a ``.tmp`` name
renamed once complete, and returns the list of its files (:class:`TaskFiles`). Spark hands the
driver exactly one result per partition — the successful attempt's — and
:func:`commit_task_files` moves exactly those files into ``<staging>/collection=<c>/`` and removes
``_attempts`` with whatever failed, retried or speculative attempts left there (a speculative
attempt still finishing after that could only write below ``_attempts/``, a name Spark, pyarrow
and DuckDB skip when they read a dataset, as they skip ``.``-names like the ``.tmp`` files). ``<staging>``
itself becomes visible only through ``spark.export.replace_dir``. The output directory must be
one file system shared by the driver and the executors (local mode; on a cluster, a shared
mount at the same path).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mst.syntax import is_valid_nsid

RECORD_FORMATS = ("json", "dag-cbor")
#: the exported repositories (did, rev), beside the collection directories (``_``: dataset readers skip it)
REPOS_FILE = "_repos.parquet"
COLUMNS = ("did", "rkey", "cid", "rev", "record")
ATTEMPTS = "_attempts"
#: bytes counted per row on top of its record (did, rkey, cid, rev and list slots)
ROW_OVERHEAD = 160


@dataclass(frozen=True, slots=True)
class ParquetLayout:
    """File sizes of the export (see the module docstring)."""

    record_format: str = "json"
    row_group_bytes: int = 64 * 1024 * 1024
    #: a task's buffers together (all collections): past this the largest becomes a file
    task_buffer_bytes: int = 256 * 1024 * 1024
    compression: str = "zstd"

    def __post_init__(self) -> None:
        if self.record_format not in RECORD_FORMATS:
            raise ValueError(f"record_format must be one of {RECORD_FORMATS}, got {self.record_format!r}")


@dataclass(frozen=True, slots=True)
class WrittenFile:
    path: str  # relative to the task's attempt directory
    collection: str
    rows: int


@dataclass(frozen=True, slots=True)
class TaskFiles:
    """What one task attempt wrote: its directory (relative to staging) and files."""

    partition: int
    attempt_dir: str
    files: tuple[WrittenFile, ...]


@dataclass(slots=True)
class _Buffer:
    """One collection's rows in column lists, with the running size and whether they are still
    in (did, rkey) order."""

    did: list[str] = field(default_factory=list)
    rkey: list[str] = field(default_factory=list)
    cid: list[str] = field(default_factory=list)
    rev: list[str] = field(default_factory=list)
    record: list[Any] = field(default_factory=list)
    size: int = 0
    last_did: str = ""
    ordered: bool = True


def schema(record_format: str) -> Any:
    """The Parquet schema of a record file (``collection`` lives in the directory name)."""
    import pyarrow as pa

    record = pa.string() if record_format == "json" else pa.binary()
    return pa.schema([pa.field(name, pa.string(), nullable=False) for name in COLUMNS[:-1]]
                     + [pa.field("record", record, nullable=False)])


def row_groups(table: Any, group_bytes: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each row group: rows are added (each counted as its record plus
    ``ROW_OVERHEAD``) until the group reaches ``group_bytes``, so a group holds at least that
    much (but the file's last) and at most that plus one row."""
    import pyarrow.compute as pc

    sizes = pc.binary_length(table.column("record")).to_pylist()
    groups: list[tuple[int, int]] = []
    start = filled = 0
    for i, size in enumerate(sizes):
        filled += size + ROW_OVERHEAD
        if filled >= group_bytes:
            groups.append((start, i + 1 - start))
            start, filled = i + 1, 0
    if start < len(sizes):
        groups.append((start, len(sizes) - start))
    return groups


def attempt_dir_name(partition: int, attempt: int) -> str:
    return f"{ATTEMPTS}/{partition:05d}-{attempt}-{uuid.uuid4().hex[:8]}"


class RecordWriter:
    """One task attempt's writer. ``add(collection, did, rev, rkeys, cids, records)`` appends one
    repository's records of one collection (``rkeys`` ascending); ``close()`` writes what is
    buffered and returns the :class:`TaskFiles`."""

    def __init__(self, staging: Path, partition: int, attempt: int, layout: ParquetLayout) -> None:
        self.layout = layout
        self.partition = partition
        self.relative = attempt_dir_name(partition, attempt)
        self.root = staging / self.relative
        self.root.mkdir(parents=True)
        self.schema = schema(layout.record_format)
        self.buffers: dict[str, _Buffer] = {}
        self.buffered = 0
        self.files: list[WrittenFile] = []

    def add(self, collection: str, did: str, rev: str, rkeys: list[str], cids: list[str],
            records: list[Any]) -> None:
        buf = self.buffers.get(collection)
        if buf is None:
            if not is_valid_nsid(collection):  # it becomes a directory name
                raise ValueError(f"invalid collection {collection[:100]!r}")
            buf = self.buffers[collection] = _Buffer()
        if did < buf.last_did:
            buf.ordered = False
        buf.last_did = did
        n = len(rkeys)
        buf.did.extend([did] * n)
        buf.rev.extend([rev] * n)
        buf.rkey.extend(rkeys)
        buf.cid.extend(cids)
        buf.record.extend(records)
        size = sum(map(len, records)) + ROW_OVERHEAD * n
        buf.size += size
        self.buffered += size
        while self.buffered > self.layout.task_buffer_bytes:
            self._flush(max(self.buffers, key=lambda c: self.buffers[c].size))

    def _flush(self, collection: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = self.buffers.pop(collection)
        self.buffered -= buf.size
        rows = len(buf.did)
        if not rows:
            return
        table = pa.Table.from_arrays(
            [pa.array(buf.did, pa.string()), pa.array(buf.rkey, pa.string()), pa.array(buf.cid, pa.string()),
             pa.array(buf.rev, pa.string()), pa.array(buf.record, self.schema.field("record").type)],
            schema=self.schema,
        )
        del buf.did, buf.rkey, buf.cid, buf.rev, buf.record
        if not buf.ordered:
            table = table.sort_by([("did", "ascending"), ("rkey", "ascending")])
        folder = self.root / f"collection={collection}"
        folder.mkdir(exist_ok=True)
        name = f"part-{self.partition:05d}-{len(self.files):04d}.parquet"
        temporary = folder / f".{name}.tmp"
        with pq.ParquetWriter(temporary, self.schema, compression=self.layout.compression,
                              use_dictionary=["did", "rev"], write_statistics=["did", "rkey", "rev"]) as out:
            for start, count in row_groups(table, self.layout.row_group_bytes):
                out.write_table(table.slice(start, count), row_group_size=count)
        os.rename(temporary, folder / name)
        self.files.append(WrittenFile(f"collection={collection}/{name}", collection, rows))

    def close(self) -> TaskFiles:
        for collection in sorted(self.buffers):
            self._flush(collection)
        return TaskFiles(self.partition, self.relative, tuple(self.files))


def commit_task_files(staging: Path, results: list[TaskFiles]) -> dict[str, int]:
    """Driver side: move the files of the attempts Spark returned (one per partition) into
    ``<staging>/collection=<c>/`` and remove every attempt directory; returns rows per
    collection. Raises ``ValueError`` if two results claim the same partition."""
    partitions = [r.partition for r in results]
    if len(set(partitions)) != len(partitions):
        raise ValueError(f"two results for one partition: {sorted(partitions)}")
    per_collection: dict[str, int] = {}
    for result in sorted(results, key=lambda r: r.partition):
        for f in result.files:
            target = staging / f.path
            target.parent.mkdir(exist_ok=True)
            os.rename(staging / result.attempt_dir / f.path, target)
            per_collection[f.collection] = per_collection.get(f.collection, 0) + f.rows
    shutil.rmtree(staging / ATTEMPTS, ignore_errors=True)
    return dict(sorted(per_collection.items()))


def write_repos(path: Path, repos: list[tuple[str, str]]) -> None:
    """Write the exported repositories ``(did, rev)`` (sorted by did) as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repos = sorted(repos)
    table = pa.table({"did": pa.array([d for d, _ in repos], pa.string()),
                      "rev": pa.array([r for _, r in repos], pa.string())})
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary, compression="zstd")
    os.rename(temporary, path)


def describe_files(root: Path, prefix: str) -> list[dict[str, Any]]:
    """Every visible file under ``root`` (not under a ``.``-name), sorted: ``{"path":
    "<prefix>/<relative path>", "bytes", "sha256"}`` (and ``collection`` for a record file)."""
    import hashlib

    out: list[dict[str, Any]] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if any(part.startswith(".") for part in relative.split("/")):
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        entry: dict[str, Any] = {"path": f"{prefix}/{relative}", "bytes": path.stat().st_size,
                                 "sha256": digest.hexdigest()}
        first = relative.split("/")[0]
        if first.startswith("collection="):
            entry["collection"] = first.removeprefix("collection=")
        out.append(entry)
    return out
