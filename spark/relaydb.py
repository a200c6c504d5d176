"""Every SQL statement the Spark jobs run against the relay database, in one place.

Relay tables (owned by ``backfill/`` migrations 0001–0049) are read and updated through the
columns of ``backfill.types.AccountState``; the jobs' own tables come from migration 0070
(``spark_job_runs``, ``spark_job_results``, ``spark_repair_outbox``). All writes are idempotent:
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

@dataclass(slots=True)
class SyncRepair:
    did: str
    host: str | None
    rev: str
    commit_cid: str
    data_cid: str
    blocks: bytes


def apply_sync_repairs(db: JobDB, run_id: str, repairs: Sequence[SyncRepair]) -> None:
    """Write back verified state and queue one ``#sync`` per repaired account.

    The update only moves an account forward (``rev`` not older than the stored one), so a live
    relay that advanced meanwhile is not rolled back; the outbox row is keyed by did+rev, so a
    rerun queues nothing new.
    """
    now = time.time()
    db.executemany(
        "UPDATE accounts SET rev = ?, commit_cid = ?, data_cid = ?, sync_state = 'synced', "
        "updated_at = ? WHERE did = ? AND (rev IS NULL OR rev <= ?)",
        [(r.rev, r.commit_cid, r.data_cid, now, r.did, r.rev) for r in repairs],
    )
    db.executemany(
        "INSERT INTO spark_repair_outbox (dedupe_key, kind, did, host, rev, commit_cid, data_cid, "
        "blocks, run_id, created_at) VALUES (?, '#sync', ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (dedupe_key) DO NOTHING",
        [
            (f"#sync|{r.did}|{r.rev}|{r.commit_cid}", r.did, r.host, r.rev, r.commit_cid, r.data_cid,
             r.blocks, run_id, now)
            for r in repairs
        ],
    )


def apply_status_changes(db: JobDB, run_id: str, changes: Sequence[tuple[str, str | None, str]]) -> None:
    """``changes``: (did, host, new upstream status). Updates the account and queues ``#account``."""
    now = time.time()
    db.executemany(
        "UPDATE accounts SET upstream_status = ?, updated_at = ? WHERE did = ? AND upstream_status <> ?",
        [(status, now, did, status) for did, _host, status in changes],
    )
    db.executemany(
        "INSERT INTO spark_repair_outbox (dedupe_key, kind, did, host, active, status, run_id, created_at) "
        "VALUES (?, '#account', ?, ?, ?, ?, ?, ?) ON CONFLICT (dedupe_key) DO NOTHING",
        [
            (f"#account|{did}|{status}|{run_id}", did, host, status == "active",
             None if status == "active" else status, run_id, now)
            for did, host, status in changes
        ],
    )


def mark_desynchronized(db: JobDB, dids: Sequence[str]) -> None:
    """Flag accounts for the resync job and the relay's own resync workers."""
    now = time.time()
    db.executemany(
        "UPDATE accounts SET sync_state = 'desynchronized', updated_at = ? "
        "WHERE did = ? AND sync_state = 'synced'",
        [(now, did) for did in dids],
    )


def add_accounts(db: JobDB, rows: Sequence[tuple[str, str, str]]) -> None:
    """``rows``: (did, host, upstream status). New accounts start desynchronized (no state yet)."""
    now = time.time()
    db.executemany(
        "INSERT INTO accounts (did, host, upstream_status, local_status, sync_state, updated_at) "
        "VALUES (?, ?, ?, 'active', 'desynchronized', ?) ON CONFLICT (did) DO NOTHING",
        [(did, host, status, now) for did, host, status in rows],
    )
    # keep the hosts' account counts exact (what Store.upsert_account maintains), idempotently
    db.executemany(
        "UPDATE hosts SET account_count = (SELECT count(*) FROM accounts WHERE host = ?) WHERE hostname = ?",
        [(host, host) for host in sorted({host for _, host, _ in rows})],
    )


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
