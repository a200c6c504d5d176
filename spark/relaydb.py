"""Every SQL statement the Spark jobs run against the relay database, in one place.

Relay tables (owned by ``backfill/`` migrations 0001–0049) are only read, through the columns
of ``backfill.types.AccountState``; the jobs write their own tables (migrations 0070, 0075:
``spark_job_runs``, ``spark_job_results``, ``spark_repair_outbox``). The relay is the single
writer of account state: it applies the outbox (``backfill.outbox``). All writes are idempotent:
re-applying a batch leaves the database as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spark.db import JobDB
from spark.repo_check import StoredAccount

ACCOUNT_COLUMNS = "did, host, rev, commit_cid, data_cid, sync_state, upstream_status"


@dataclass(frozen=True, slots=True)
class AccountFilter:
    """Which accounts a job selects. Empty tuples mean "any"."""

    hosts: tuple[str, ...] = ()
    sync_states: tuple[str, ...] = ()
    include_inactive: bool = False
    skip_finished_run: str | None = None  # run id whose finished repositories are skipped
    retry_failed: bool = False

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        args: list[Any] = []
        if self.hosts:
            clauses.append("a.host IN (" + ",".join("?" * len(self.hosts)) + ")")
            args += list(self.hosts)
        if self.sync_states:
            clauses.append("a.sync_state IN (" + ",".join("?" * len(self.sync_states)) + ")")
            args += list(self.sync_states)
        if not self.include_inactive:
            clauses.append("a.upstream_status = 'active' AND a.local_status = 'active'")
        if self.skip_finished_run:
            failed = " AND r.outcome <> 'failed'" if self.retry_failed else ""
            clauses.append(
                "NOT EXISTS (SELECT 1 FROM spark_job_results r WHERE r.run_id = ? AND r.did = a.did"
                + failed + ")"
            )
            args.append(self.skip_finished_run)
        clauses.append("a.host IS NOT NULL")
        return " AND ".join(clauses), args


def did_boundaries(db: JobDB, parts: int, flt: AccountFilter) -> list[tuple[str | None, str | None]]:
    """Split the selected accounts into ``parts`` contiguous DID ranges ``[lo, hi)`` of about equal
    size (one ordered index scan picks every ``step``-th DID), so executors read them in parallel."""
    where, args = flt.where()
    total = int(db.fetchval(f"SELECT count(*) FROM accounts a WHERE {where}", *args) or 0)
    parts = max(1, min(parts, total))
    step = -(-total // parts) if total else 1
    cuts: list[str] = []
    if parts > 1:
        rows = db.fetch(
            "SELECT did FROM (SELECT a.did, row_number() OVER (ORDER BY a.did) AS rn "
            f"FROM accounts a WHERE {where}) t WHERE (rn - 1) % ? = 0 AND rn > 1 ORDER BY did",
            *args, step,
        )
        cuts = [row["did"] for row in rows]
    bounds: list[str | None] = [None, *cuts, None]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def read_accounts(
    db: JobDB, lo: str | None, hi: str | None, flt: AccountFilter
) -> list[StoredAccount]:
    """Selected accounts with ``lo <= did < hi``."""
    where, args = flt.where()
    if lo is not None:
        where += " AND a.did >= ?"
        args.append(lo)
    if hi is not None:
        where += " AND a.did < ?"
        args.append(hi)
    cols = ", ".join(f"a.{c.strip()}" for c in ACCOUNT_COLUMNS.split(","))
    rows = db.fetch(f"SELECT {cols} FROM accounts a WHERE {where} ORDER BY a.did", *args)
    return [StoredAccount(**row) for row in rows]


def accounts_by_did(db: JobDB, dids: Sequence[str]) -> dict[str, StoredAccount]:
    if not dids:
        return {}
    marks = ",".join("?" * len(dids))
    rows = db.fetch(f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE did IN ({marks})", *dids)
    return {row["did"]: StoredAccount(**row) for row in rows}


def dids_on_host(db: JobDB, host: str) -> set[str]:
    return {row["did"] for row in db.fetch("SELECT did FROM accounts WHERE host = ?", host)}


# -- job bookkeeping -----------------------------------------------------------------------

def start_run(db: JobDB, run_id: str, job: str, params: dict[str, Any]) -> None:
    """Record a run (no-op when resuming an existing run id)."""
    db.execute(
        "INSERT INTO spark_job_runs (run_id, job, params, started_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (run_id) DO NOTHING",
        run_id, job, json.dumps(params, sort_keys=True), time.time(),
    )


def finish_run(db: JobDB, run_id: str, summary: dict[str, Any]) -> None:
    db.execute(
        "UPDATE spark_job_runs SET summary = ?, finished_at = ? WHERE run_id = ?",
        json.dumps(summary, sort_keys=True), time.time(), run_id,
    )


def latest_unfinished_run(db: JobDB, job: str) -> str | None:
    run_id: str | None = db.fetchval(
        "SELECT run_id FROM spark_job_runs WHERE job = ? AND finished_at IS NULL "
        "ORDER BY started_at DESC LIMIT 1",
        job,
    )
    return run_id


@dataclass(slots=True)
class ResultRow:
    did: str
    host: str | None
    outcome: str
    reason: str | None = None
    records: int = 0
    bytes: int = 0
    rev: str | None = None


def write_results(db: JobDB, run_id: str, job: str, rows: Iterable[ResultRow]) -> None:
    now = time.time()
    db.executemany(
        "INSERT INTO spark_job_results (run_id, job, did, host, outcome, reason, records, bytes, rev, "
        "finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, did) DO UPDATE SET "
        "outcome = excluded.outcome, reason = excluded.reason, records = excluded.records, "
        "bytes = excluded.bytes, rev = excluded.rev, host = excluded.host, "
        "finished_at = excluded.finished_at",
        [(run_id, job, r.did, r.host, r.outcome, r.reason, r.records, r.bytes, r.rev, now) for r in rows],
    )


def result_counts(db: JobDB, run_id: str) -> dict[str, int]:
    rows = db.fetch(
        "SELECT outcome, count(*) AS n FROM spark_job_results WHERE run_id = ? GROUP BY outcome", run_id
    )
    return {row["outcome"]: int(row["n"]) for row in rows}


# -- repairs ------------------------------------------------------------------------------
# The jobs never write ``accounts``: each finding is queued in ``spark_repair_outbox`` with what
# the job saw (``base_*``) and when it looked (``observed_at``), and the running relay applies it
# in the account's lane with a compare-and-set (``backfill.outbox``).

_QUEUE_SQL = (
    "INSERT INTO spark_repair_outbox (dedupe_key, kind, did, host, rev, commit_cid, data_cid, blocks, active, "
    "status, base_rev, base_commit_cid, base_status, observed_at, run_id, created_at, collections) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (dedupe_key) DO NOTHING"
)


@dataclass(slots=True)
class SyncRepair:
    did: str
    host: str | None
    rev: str
    commit_cid: str
    data_cid: str
    blocks: bytes
    base: StoredAccount | None = None  # the relay's row as the job read it
    observed_at: float = 0.0  # when the repository was fetched
    collections: dict[str, int] | None = None  # the repository's record counts per collection


@dataclass(slots=True)
class Finding:
    """A reconcile finding for the relay: ``kind`` ``#account`` (``status`` is the host's),
    ``desync`` or ``add`` (``status`` is the listed one)."""

    kind: str
    did: str
    host: str
    status: str = "active"
    base: StoredAccount | None = None
    observed_at: float = 0.0


def _base_columns(base: StoredAccount | None) -> tuple[str | None, str | None, str | None]:
    """``base_rev, base_commit_cid, base_status``: the relay's row as the job read it (or NULLs)."""
    if base is None:
        return None, None, None
    return base.rev, base.commit_cid, base.upstream_status


def queue_sync_repairs(db: JobDB, run_id: str, repairs: Sequence[SyncRepair]) -> None:
    """Queue one ``#sync`` repair per verified repository. Keyed by did+rev+commit, so a rerun
    (or a second job finding the same state) queues nothing new."""
    now = time.time()
    db.executemany(_QUEUE_SQL, [
        (f"#sync|{r.did}|{r.rev}|{r.commit_cid}", "#sync", r.did, r.host, r.rev, r.commit_cid, r.data_cid,
         r.blocks, None, None, *_base_columns(r.base), r.observed_at or now, run_id, now,
         json.dumps(r.collections, sort_keys=True) if r.collections is not None else None)
        for r in repairs
    ])


def repair_outcomes(db: JobDB, run_id: str) -> dict[str, int]:
    """What the relay did with the rows ``run_id`` queued: count per outcome (``applied``, ``stale``
    — not newer than what the relay accepted since the job looked, discarded —, ``desync_cleared``,
    …) and ``pending`` for rows the relay has not consumed yet."""
    rows = db.fetch(
        "SELECT COALESCE(outcome, 'pending') AS outcome, count(*) AS n FROM spark_repair_outbox "
        "WHERE run_id = ? GROUP BY COALESCE(outcome, 'pending')", run_id
    )
    return {row["outcome"]: int(row["n"]) for row in rows}


def queue_findings(db: JobDB, run_id: str, findings: Sequence[Finding]) -> None:
    """Queue reconcile's findings (one row per account and kind per run)."""
    now = time.time()
    rows = []
    for f in findings:
        active = f.status == "active"
        rows.append((
            f"{f.kind}|{f.did}|{f.status}|{run_id}", f.kind, f.did, f.host, None, None, None, None, active,
            None if active else f.status, *_base_columns(f.base), f.observed_at or now, run_id, now, None,
        ))
    db.executemany(_QUEUE_SQL, rows)


def relay_seq(db: JobDB) -> int:
    """The relay's current sequence number (its high-water mark; 0 for an empty relay)."""
    for sql in (
        "SELECT value FROM relay_meta WHERE key = 'seq_high_water'",
        "SELECT max(seq) FROM events",
    ):
        try:
            value = db.fetchval(sql)
        except Exception:  # noqa: BLE001 - table layout probe; fall through to the next form
            continue
        if value is not None:
            return int(value)
    return 0
