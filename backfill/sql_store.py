"""The store core: every part of ``backfill.store.Store`` that does not depend on the SQL dialect,
written once for both backends.

A backend (``backfill.postgres_store``, ``backfill.sqlite_store``) subclasses :class:`SqlStore` and
keeps only its dialect: connection handling, the primitives below, locking (migrations, the writer
lease) and the multi-statement transactions whose SQL differs (the sequencer's batch, account and
identity upserts, a cursor reset, a trim step). Statements here are written with ``?``
placeholders, which the PostgreSQL backend renumbers to ``$n``; they use only SQL both dialects
read alike. Rows come back as sequences (tuples or asyncpg records) in the selected column order.

Contracts of the public methods: see ``backfill.store.Store``.
"""

from __future__ import annotations

import asyncio
import time
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from backfill.identities import IDENTITY_COLS, Identity, identity_from_row
from backfill.store import Store, audit_entry
from backfill.types import HostState
from firehose.state import AccountState, SequencedEvent

ACCOUNT_COLS = "did, host, upstream_status, local_status, rev, commit_cid, data_cid, sync_state, updated_at"
HOST_COLS = (
    "hostname, status, upstream_cursor, account_limit, trusted, rate_limit_per_second, "
    "rate_limit_per_hour, rate_limit_per_day, last_seen, account_count, created_at, is_relay, lenient_sync"
)


def keep_head_sql(new: str, old: str) -> str:
    """The SET of an account row's head (``rev``, ``commit_cid``, ``data_cid``) from the row ``new``
    over the stored row ``old``: a new row without a rev keeps the stored head (the lanes never
    write one over a rev; were one written, the stored rev must not become NULL)."""
    return (f"rev = COALESCE({new}.rev, {old}.rev), "
            f"commit_cid = CASE WHEN {new}.rev IS NULL THEN {old}.commit_cid ELSE {new}.commit_cid END, "
            f"data_cid = CASE WHEN {new}.rev IS NULL THEN {old}.data_cid ELSE {new}.data_cid END")


#: An account row as both backends write it (``ACCOUNT_COLS`` order; ``excluded`` = the new row).
UPSERT_ACCOUNT_SQL = (
    f"INSERT INTO accounts ({ACCOUNT_COLS}) VALUES (?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (did) DO UPDATE SET host = excluded.host, upstream_status = excluded.upstream_status, "
    f"local_status = excluded.local_status, {keep_head_sql('excluded', 'accounts')}, "
    "sync_state = excluded.sync_state, updated_at = excluded.updated_at"
)
_UPSERT_HOST_SQL = (
    f"INSERT INTO hosts ({HOST_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (hostname) DO UPDATE SET status = excluded.status, "
    "account_limit = excluded.account_limit, trusted = excluded.trusted, "
    "rate_limit_per_second = excluded.rate_limit_per_second, "
    "rate_limit_per_hour = excluded.rate_limit_per_hour, "
    "rate_limit_per_day = excluded.rate_limit_per_day, "
    "last_seen = COALESCE(excluded.last_seen, hosts.last_seen), "
    "is_relay = excluded.is_relay, lenient_sync = excluded.lenient_sync"
)
# `active` mirrors the account's two statuses (migration 0081's triggers), so a page is one range
# scan from the cursor to the limit with no account lookup per row (PostgreSQL: index-only, on the
# partial index repo_collections_active_idx; a join's generic plan merge-joined against the whole
# accounts index: 161-440 ms at 100,000 accounts; a correlated lookup per row: 9.4 ms p99 for 2,000
# rows; this: 2.3 ms, bench/repos_by_collection.py. SQLite: the WITHOUT ROWID primary key holds the row).
_REPOS_BY_COLLECTION_SQL = (
    "SELECT did FROM repo_collections WHERE collection = ? AND did > ? AND active ORDER BY did LIMIT ?"
)
#: The repair outbox (migrations 0070, 0075) as ``Store.pending_repairs`` reads it.
PENDING_REPAIRS_COLUMNS = (
    "id", "kind", "did", "host", "rev", "commit_cid", "data_cid", "blocks", "active", "status", "base_rev",
    "base_commit_cid", "base_status", "observed_at", "created_at", "run_id", "collections",
)
_PENDING_REPAIRS_SQL = (
    f"SELECT {', '.join(PENDING_REPAIRS_COLUMNS)} "
    "FROM spark_repair_outbox WHERE consumed_at IS NULL AND id > ? ORDER BY id LIMIT ?"
)
_REPAIR_DONE_SQL = "UPDATE spark_repair_outbox SET consumed_at = ?, seq = ?, outcome = ? WHERE id = ?"


def account_from_row(row: Sequence[Any]) -> AccountState:
    """An ``accounts`` row (``ACCOUNT_COLS``) as an ``AccountState``."""
    return AccountState(*row)


def host_from_row(row: Sequence[Any]) -> HostState:
    """A ``hosts`` row (``HOST_COLS``) as a ``HostState`` (SQLite keeps the flags as integers)."""
    values = list(row)
    values[4] = bool(values[4])
    values[11] = bool(values[11])
    values[12] = None if values[12] is None else bool(values[12])
    return HostState(*values)


class SqlStore(Store):
    """``Store`` over five dialect primitives; see the module docstring."""

    # -- the dialect's primitives ---------------------------------------------------------------
    @abstractmethod
    async def _fetch(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        """Every row of one read (``?`` placeholders)."""

    @abstractmethod
    async def _fetchval(self, sql: str, *args: Any) -> Any:
        """The first column of the first row of one read, or None when there is no row."""

    @abstractmethod
    async def _execute(self, sql: str, *args: Any) -> int:
        """Run one write statement in its own transaction; returns the rows it changed."""

    @abstractmethod
    async def _fetch_in(self, select: str, column: str, keys: list[str]) -> Sequence[Sequence[Any]]:
        """Rows of ``select`` (a statement without a WHERE clause) whose ``column`` is one of
        ``keys`` (not empty, no duplicates), in no particular order."""

    @abstractmethod
    async def _trim_step(self, batch: int, cutoff: float | None, max_bytes: int | None) -> int:
        """One short transaction of ``trim``: of the oldest ``batch`` events, delete the prefix
        ``backfill.store.retention_prefix`` chooses and lower ``events_bytes`` by their bytes
        (reset it to 0 when the window is empty); returns the rows deleted."""

    # -- lifecycle ---------------------------------------------------------------------------
    async def applied_migrations(self) -> list[int]:
        return [int(r[0]) for r in await self._fetch("SELECT version FROM schema_migrations ORDER BY version")]

    # -- events ------------------------------------------------------------------------------
    async def read_after(self, cursor: int, limit: int = 1000) -> list[SequencedEvent]:
        rows = await self._fetch(
            "SELECT seq, did, kind, time, frame FROM events WHERE seq > ? ORDER BY seq LIMIT ?", cursor, limit
        )
        return [SequencedEvent(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def oldest_seq(self) -> int | None:
        value = await self._fetchval("SELECT seq FROM events ORDER BY seq LIMIT 1")
        return None if value is None else int(value)

    async def latest_seq(self) -> int:
        return int(await self._fetchval("SELECT value FROM relay_meta WHERE key = 'seq_high_water'"))

    async def count_events(self) -> int:
        return int(await self._fetchval("SELECT count(*) FROM events"))

    async def events_bytes(self) -> int:
        return int(await self._fetchval("SELECT value FROM relay_meta WHERE key = 'events_bytes'"))

    async def trim(
        self,
        older_than_seconds: float | None = None,
        max_bytes: int | None = None,
        batch: int = 2000,
        *,
        now: float | None = None,
    ) -> int:
        if older_than_seconds is None and max_bytes is None:
            return 0
        cutoff = None if older_than_seconds is None else (now or time.time()) - older_than_seconds
        total = 0
        while True:
            count = await self._trim_step(batch, cutoff, max_bytes)
            total += count
            if count < batch:
                return total
            await asyncio.sleep(0)  # let ingest and readers in between batches

    # -- accounts ----------------------------------------------------------------------------
    async def get_account(self, did: str) -> AccountState | None:
        rows = await self._fetch(f"SELECT {ACCOUNT_COLS} FROM accounts WHERE did = ?", did)
        return account_from_row(rows[0]) if rows else None

    async def account_heads(self, dids: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
        wanted = list(dict.fromkeys(dids))
        rows = await self._fetch_in("SELECT did, host, rev FROM accounts", "did", wanted) if wanted else []
        return {r[0]: (r[1], r[2]) for r in rows}

    async def get_accounts(self, dids: Iterable[str]) -> dict[str, AccountState]:
        wanted = list(dict.fromkeys(dids))
        rows = await self._fetch_in(f"SELECT {ACCOUNT_COLS} FROM accounts", "did", wanted) if wanted else []
        return {r[0]: account_from_row(r) for r in rows}

    async def list_accounts(self, after_did: str | None = None, limit: int = 500) -> list[AccountState]:
        rows = await self._fetch(
            f"SELECT {ACCOUNT_COLS} FROM accounts WHERE did > ? ORDER BY did LIMIT ?", after_did or "", limit
        )
        return [account_from_row(r) for r in rows]

    async def accounts_by_sync_state(
        self, state: str, limit: int = 500, *, after_did: str | None = None
    ) -> list[AccountState]:
        # The extra predicate lets the planner use the partial index for every non-synced state.
        partial = " AND sync_state <> 'synced'" if state != "synced" else ""
        rows = await self._fetch(
            f"SELECT {ACCOUNT_COLS} FROM accounts WHERE sync_state = ?{partial} AND did > ? ORDER BY did LIMIT ?",
            state, after_did or "", limit,
        )
        return [account_from_row(r) for r in rows]

    async def count_accounts(self, host: str | None = None) -> int:
        if host is None:
            return int(await self._fetchval("SELECT count(*) FROM accounts"))
        return int(await self._fetchval("SELECT count(*) FROM accounts WHERE host = ?", host))

    async def count_accounts_by_host(self, sync_state: str) -> dict[str, int]:
        rows = await self._fetch(
            "SELECT host, count(*) FROM accounts WHERE sync_state = ? AND host IS NOT NULL GROUP BY host", sync_state
        )
        return {r[0]: int(r[1]) for r in rows}

    # -- collections -------------------------------------------------------------------------
    async def list_repos_by_collection(self, collection: str, after_did: str | None = None,
                                       limit: int = 500) -> list[str]:
        rows = await self._fetch(_REPOS_BY_COLLECTION_SQL, collection, after_did or "", limit)
        return [r[0] for r in rows]

    async def collection_counts(self, did: str) -> dict[str, int]:
        rows = await self._fetch("SELECT collection, records FROM repo_collections WHERE did = ?", did)
        return {r[0]: int(r[1]) for r in rows}

    # -- persisted identities ----------------------------------------------------------------
    async def get_identities(self, dids: Iterable[str]) -> dict[str, Identity | None]:
        wanted = list(dict.fromkeys(dids))
        rows = await self._fetch_in(f"SELECT {IDENTITY_COLS} FROM identities", "did", wanted) if wanted else []
        return {r[0]: identity_from_row(r) for r in rows}

    # -- hosts -------------------------------------------------------------------------------
    async def get_host(self, hostname: str) -> HostState | None:
        rows = await self._fetch(f"SELECT {HOST_COLS} FROM hosts WHERE hostname = ?", hostname)
        return host_from_row(rows[0]) if rows else None

    async def list_hosts(self, after: str | None = None, limit: int = 500) -> list[HostState]:
        rows = await self._fetch(
            f"SELECT {HOST_COLS} FROM hosts WHERE hostname > ? ORDER BY hostname LIMIT ?", after or "", limit
        )
        return [host_from_row(r) for r in rows]

    async def upsert_host(self, host: HostState) -> None:
        await self._execute(
            _UPSERT_HOST_SQL,
            host.hostname, host.status, host.cursor, host.account_limit, host.trusted,
            host.rate_limit_per_second, host.rate_limit_per_hour, host.rate_limit_per_day,
            host.last_seen, host.account_count, host.created_at or time.time(), host.relay, host.lenient,
        )

    async def set_host_status(self, hostname: str, status: str) -> bool:
        return await self._execute("UPDATE hosts SET status = ? WHERE hostname = ?", status, hostname) == 1

    async def host_cursor(self, hostname: str) -> int | None:
        value = await self._fetchval("SELECT upstream_cursor FROM hosts WHERE hostname = ?", hostname)
        return None if value is None else int(value)

    async def upstream_done_above(self, hostname: str, cursor: int) -> list[int]:
        await self._execute("DELETE FROM upstream_done WHERE host = ? AND upstream_seq <= ?", hostname, cursor)
        rows = await self._fetch(
            "SELECT upstream_seq FROM upstream_done WHERE host = ? ORDER BY upstream_seq", hostname
        )
        return [int(r[0]) for r in rows]

    # -- domain bans -------------------------------------------------------------------------
    async def list_domain_bans(self) -> list[str]:
        return [r[0] for r in await self._fetch("SELECT domain FROM domain_bans ORDER BY domain")]

    async def add_domain_ban(self, domain: str) -> bool:
        changed = await self._execute(
            "INSERT INTO domain_bans (domain, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
            domain.strip().lower(), time.time(),
        )
        return changed == 1

    async def remove_domain_ban(self, domain: str) -> bool:
        return await self._execute("DELETE FROM domain_bans WHERE domain = ?", domain.strip().lower()) == 1

    # -- operator state ----------------------------------------------------------------------
    async def get_setting(self, key: str) -> str | None:
        value = await self._fetchval("SELECT value FROM relay_settings WHERE key = ?", key)
        return None if value is None else str(value)

    async def set_setting(self, key: str, value: str) -> None:
        await self._execute(
            "INSERT INTO relay_settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key, value,
        )

    async def record_crawl_admission(self, hostname: str, at: float) -> None:
        await self._execute(
            "INSERT INTO crawl_requests (hostname, result, requested_at) VALUES (?, 'accepted', ?)", hostname, at
        )

    async def count_crawl_admissions(self, since: float) -> int:
        return int(await self._fetchval(
            "SELECT count(*) FROM crawl_requests WHERE result = 'accepted' AND requested_at >= ?", since
        ))

    async def record_admin_action(self, at: float, action: str, target: str, detail: str) -> None:
        await self._execute(
            "INSERT INTO admin_audit (time, action, target, detail) VALUES (?, ?, ?, ?)", at, action, target, detail
        )

    async def list_admin_actions(self, limit: int = 200) -> list[dict[str, Any]]:
        rows = await self._fetch(
            "SELECT time, action, target, detail FROM admin_audit ORDER BY id DESC LIMIT ?", limit
        )
        return [audit_entry(*row) for row in reversed(rows)]

    # -- the Spark repair outbox -------------------------------------------------------------
    async def pending_repairs(self, limit: int = 500, after_id: int = 0) -> list[dict[str, Any]]:
        rows = await self._fetch(_PENDING_REPAIRS_SQL, after_id, limit)
        return [dict(zip(PENDING_REPAIRS_COLUMNS, row, strict=True)) for row in rows]

    async def mark_repair_consumed(self, row_id: int, at: float, seq: int | None, outcome: str) -> None:
        await self._execute(_REPAIR_DONE_SQL, at, seq, outcome, row_id)
