"""PostgreSQL backend (asyncpg). See ``backfill.store`` for the contract of every method.

Events are written with binary ``COPY`` inside the batch transaction; the frame column is
``STORAGE EXTERNAL`` (no compression attempts on CAR bytes). Locks are advisory locks keyed by
database and schema, so several relays (or tests) can share a server in separate schemas.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import asyncpg

from backfill.errors import MigrationError, SequencerConflictError, SequencerLockedError
from backfill.identities import (
    FRESHER_ONLY,
    IDENTITY_COLS,
    Identity,
    IdentityWrite,
    identity_from_row,
    identity_row,
)
from backfill.migrations import discover
from backfill.store import (
    PENDING_REPAIRS_SQL,
    REPAIR_DONE_SQL,
    BatchWrite,
    Store,
    WriterLease,
    audit_entry,
    host_count_deltas,
    retention_prefix,
    writer_identity,
)
from backfill.types import HostState
from firehose.state import AccountState, SequencedEvent, account_row

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _numbered(sql: str) -> str:
    """A statement written with ``?`` placeholders (shared with SQLite) in asyncpg's ``$n`` form."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], start=1))

_ACCOUNT_COLS = "did, host, upstream_status, local_status, rev, commit_cid, data_cid, sync_state, updated_at"
_HOST_COLS = (
    "hostname, status, upstream_cursor, account_limit, trusted, rate_limit_per_second, "
    "rate_limit_per_hour, rate_limit_per_day, last_seen, account_count, created_at, is_relay, lenient_sync"
)

# Batch write of account state from the sequencer: the batch is COPYed into a per-connection
# temporary staging table (binary COPY: far cheaper to encode than nine text arrays), then one
# UPDATE covers the existing accounts (the common case) and one INSERT the new ones.
# Every column is written, local_status too: an account's lane is the only writer of its row, and
# a takedown is an operation of the lane, so no event in flight can carry a stale local_status.
_STAGE = "relay_account_stage"
_SQL_CREATE_STAGE = f"""
CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} (
    did text, host text, upstream_status text, local_status text, rev text, commit_cid text,
    data_cid text, sync_state text, updated_at double precision
) ON COMMIT DELETE ROWS
"""
# Sent without parameters (simple protocol), so each is planned with the staged row count known.
_SQL_UPDATE_ACCOUNTS = f"""
UPDATE accounts a SET host = s.host, upstream_status = s.upstream_status, local_status = s.local_status, rev = s.rev,
    commit_cid = s.commit_cid, data_cid = s.data_cid, sync_state = s.sync_state, updated_at = s.updated_at
FROM pg_temp.{_STAGE} s
WHERE a.did = s.did
"""
_SQL_INSERT_ACCOUNTS = f"""
INSERT INTO accounts ({_ACCOUNT_COLS})
SELECT {_ACCOUNT_COLS} FROM pg_temp.{_STAGE} s
WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.did = s.did)
ON CONFLICT (did) DO UPDATE SET
    host = EXCLUDED.host, upstream_status = EXCLUDED.upstream_status, local_status = EXCLUDED.local_status,
    rev = EXCLUDED.rev, commit_cid = EXCLUDED.commit_cid, data_cid = EXCLUDED.data_cid,
    sync_state = EXCLUDED.sync_state, updated_at = EXCLUDED.updated_at
"""

_SQL_UPDATE_HOSTS = """
INSERT INTO hosts (hostname, upstream_cursor, last_seen, account_count, created_at)
SELECT h, COALESCE(c, 0), s, d, $5 FROM unnest($1::text[], $2::int8[], $3::float8[], $4::int8[])
    AS u(h, c, s, d)
ON CONFLICT (hostname) DO UPDATE SET
    upstream_cursor = GREATEST(hosts.upstream_cursor, COALESCE(EXCLUDED.upstream_cursor, 0)),
    last_seen = COALESCE(EXCLUDED.last_seen, hosts.last_seen),
    account_count = hosts.account_count + EXCLUDED.account_count
"""

# One statement for a whole batch of identity writes (unique DIDs: a flush holds one write per DID).
_SQL_PUT_IDENTITIES = f"""
INSERT INTO identities ({IDENTITY_COLS})
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[], $6::float8[], $7::float8[])
{FRESHER_ONLY}
"""


def _account(row: asyncpg.Record) -> AccountState:
    return AccountState(*row)


def _host(row: asyncpg.Record) -> HostState:
    return HostState(*row)


#: asyncpg errors that mean the server is unreachable, restarting or shutting down (SQLSTATE classes
#: 08 connection exception, 57 operator intervention, 53300 too many connections), or that the
#: client connection is gone; anything else (data, constraint, syntax) is not retried.
_TRANSIENT_PG: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)


class PostgresStore(Store):
    backend = "postgres"

    def __init__(self, dsn: str, schema: str | None, pool: asyncpg.Pool) -> None:
        self.dsn = dsn
        self.schema = schema
        self._pool = pool
        self._closed = False

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, _TRANSIENT_PG) or super().is_transient(exc)

    @classmethod
    async def connect(cls, dsn: str, *, schema: str | None = None, pool_size: int = 4) -> PostgresStore:
        if schema is not None and not _SCHEMA_RE.match(schema):
            raise ValueError(f"invalid schema name: {schema!r}")
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=pool_size, server_settings=cls._settings(schema)
        )
        return cls(dsn, schema, pool)

    @staticmethod
    def _settings(schema: str | None) -> dict[str, str]:
        settings = {"application_name": "relay"}
        if schema:
            settings["search_path"] = schema
        return settings

    def _lock_name(self, purpose: str) -> str:
        return f"relay.{purpose}/{self.schema or 'public'}"

    async def _connect_dedicated(self, application_name: str | None = None) -> asyncpg.Connection:
        settings = self._settings(self.schema)
        if application_name:
            settings["application_name"] = application_name[:63]  # NAMEDATALEN - 1
        return await asyncpg.connect(self.dsn, server_settings=settings)

    # -- lifecycle ---------------------------------------------------------------------------
    async def migrate(self) -> list[int]:
        migrations = discover("postgres")
        applied_now: list[int] = []
        conn = await self._connect_dedicated()
        try:
            # Serialise concurrent runners (other processes, other replicas) per schema.
            await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", self._lock_name("migrate"))
            try:
                if self.schema:
                    await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations ("
                    " version integer PRIMARY KEY, name text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                )
                done = {r[0] for r in await conn.fetch("SELECT version FROM schema_migrations")}
                for migration in migrations:
                    if migration.version in done:
                        continue
                    try:
                        async with conn.transaction():
                            await conn.execute(migration.sql)
                            await conn.execute(
                                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                                migration.version,
                                migration.name,
                            )
                    except asyncpg.PostgresError as exc:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} failed: {exc}"
                        ) from exc
                    applied_now.append(migration.version)
            finally:
                await conn.execute(
                    "SELECT pg_advisory_unlock(hashtextextended($1, 0))", self._lock_name("migrate")
                )
        finally:
            await conn.close()
        return applied_now

    async def applied_migrations(self) -> list[int]:
        rows = await self._pool.fetch("SELECT version FROM schema_migrations ORDER BY version")
        return [r[0] for r in rows]

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._pool.close()

    async def acquire_writer(self, *, wait: bool = False, timeout: float | None = None) -> WriterLease:
        # the lease's connection carries its holder's name: a standby reads it (writer_holder)
        conn = await self._connect_dedicated(f"relay-writer {writer_identity()}")
        name = self._lock_name("sequencer")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if await conn.fetchval("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", name):
                    return _PgLease(conn)
                if not wait or (deadline is not None and time.monotonic() >= deadline):
                    raise SequencerLockedError(
                        f"another sequencer holds the write lock on schema "
                        f"{self.schema or 'public'!r}: only one relay ingest process may write "
                        f"to a database; stop the other one or point this one elsewhere"
                    )
                await asyncio.sleep(0.2)
        except BaseException:
            await conn.close()
            raise

    async def writer_holder(self) -> str | None:
        """The backend holding the sequencer's advisory lock in this database, from ``pg_locks``
        (a bigint advisory key is ``classid << 32 | objid``, ``objsubid`` 1) and
        ``pg_stat_activity`` (its ``application_name`` is ``relay-writer <host> pid <pid>``)."""
        row = await self._pool.fetchrow(
            "SELECT a.application_name, host(a.client_addr), a.pid FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)",
            self._lock_name("sequencer"),
        )
        if row is None:
            return None
        name = (row[0] or "").removeprefix("relay-writer ") or "unnamed client"
        return f"{name} (PostgreSQL backend {row[2]}" + (f", from {row[1]})" if row[1] else ")")

    # -- events ------------------------------------------------------------------------------
    async def read_after(self, cursor: int, limit: int = 1000) -> list[SequencedEvent]:
        rows = await self._pool.fetch(
            "SELECT seq, did, kind, time, frame FROM events WHERE seq > $1 ORDER BY seq LIMIT $2",
            cursor,
            limit,
        )
        return [SequencedEvent(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def oldest_seq(self) -> int | None:
        return await self._pool.fetchval("SELECT seq FROM events ORDER BY seq LIMIT 1")

    async def latest_seq(self) -> int:
        return await self._pool.fetchval("SELECT value FROM relay_meta WHERE key = 'seq_high_water'")

    async def count_events(self) -> int:
        return await self._pool.fetchval("SELECT count(*) FROM events")

    async def events_bytes(self) -> int:
        return await self._pool.fetchval("SELECT value FROM relay_meta WHERE key = 'events_bytes'")

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
        async with self._pool.acquire() as conn:
            while True:
                async with conn.transaction():
                    rows = await conn.fetch(
                        "SELECT seq, time, octet_length(frame) FROM events ORDER BY seq LIMIT $1", batch
                    )
                    if not rows:
                        # Empty window (maybe truncated by hand): the byte counter restarts.
                        await conn.execute("UPDATE relay_meta SET value = 0 WHERE key = 'events_bytes'")
                        return total
                    excess = 0
                    if max_bytes is not None:
                        stored = await conn.fetchval(
                            "SELECT value FROM relay_meta WHERE key = 'events_bytes'"
                        )
                        excess = max(0, stored - max_bytes)
                    count, freed = retention_prefix(rows, cutoff, excess)
                    if count:
                        await conn.execute(
                            "DELETE FROM events WHERE seq >= $1 AND seq <= $2", rows[0][0], rows[count - 1][0]
                        )
                        await conn.execute(
                            "UPDATE relay_meta SET value = GREATEST(0, value - $1) WHERE key = 'events_bytes'",
                            freed,
                        )
                total += count
                if count < batch:
                    return total
                await asyncio.sleep(0)  # let ingest and readers in between batches

    # -- accounts ----------------------------------------------------------------------------
    async def get_account(self, did: str) -> AccountState | None:
        row = await self._pool.fetchrow(f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did = $1", did)
        return None if row is None else _account(row)

    async def account_heads(self, dids: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
        rows = await self._pool.fetch(
            "SELECT did, host, rev FROM accounts WHERE did = ANY($1::text[])", list(dids)
        )
        return {r[0]: (r[1], r[2]) for r in rows}

    async def get_accounts(self, dids: Iterable[str]) -> dict[str, AccountState]:
        rows = await self._pool.fetch(
            f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did = ANY($1::text[])", list(dids)
        )
        return {r[0]: _account(r) for r in rows}

    async def upsert_account(self, state: AccountState) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            old_host = await conn.fetchrow("SELECT host FROM accounts WHERE did = $1 FOR UPDATE", state.did)
            await conn.execute(
                f"INSERT INTO accounts ({_ACCOUNT_COLS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) "
                "ON CONFLICT (did) DO UPDATE SET host = EXCLUDED.host, "
                "upstream_status = EXCLUDED.upstream_status, local_status = EXCLUDED.local_status, "
                "rev = EXCLUDED.rev, commit_cid = EXCLUDED.commit_cid, data_cid = EXCLUDED.data_cid, "
                "sync_state = EXCLUDED.sync_state, updated_at = EXCLUDED.updated_at",
                state.did,
                state.host,
                state.upstream_status,
                state.local_status,
                state.rev,
                state.commit_cid,
                state.data_cid,
                state.sync_state,
                state.updated_at or time.time(),
            )
            deltas = host_count_deltas(old_host is not None, old_host[0] if old_host else None, state.host)
            if deltas:
                await conn.execute(
                    _SQL_UPDATE_HOSTS,
                    list(deltas),
                    [None] * len(deltas),
                    [None] * len(deltas),
                    list(deltas.values()),
                    time.time(),
                )

    async def list_accounts(self, after_did: str | None = None, limit: int = 500) -> list[AccountState]:
        rows = await self._pool.fetch(
            f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did > $1 ORDER BY did LIMIT $2",
            after_did or "",
            limit,
        )
        return [_account(r) for r in rows]

    async def accounts_by_sync_state(
        self, state: str, limit: int = 500, *, after_did: str | None = None
    ) -> list[AccountState]:
        # The extra predicate lets the planner use the partial index for every non-synced state.
        partial = " AND sync_state <> 'synced'" if state != "synced" else ""
        rows = await self._pool.fetch(
            f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE sync_state = $1{partial} AND did > $3 "
            "ORDER BY did LIMIT $2",
            state,
            limit,
            after_did or "",
        )
        return [_account(r) for r in rows]

    async def count_accounts(self, host: str | None = None) -> int:
        if host is None:
            return await self._pool.fetchval("SELECT count(*) FROM accounts")
        return await self._pool.fetchval("SELECT count(*) FROM accounts WHERE host = $1", host)

    async def count_accounts_by_host(self, sync_state: str) -> dict[str, int]:
        rows = await self._pool.fetch(
            "SELECT host, count(*) FROM accounts WHERE sync_state = $1 AND host IS NOT NULL GROUP BY host", sync_state)
        return {r[0]: int(r[1]) for r in rows}

    # -- persisted identities ----------------------------------------------------------------
    async def get_identities(self, dids: Iterable[str]) -> dict[str, Identity | None]:
        rows = await self._pool.fetch(
            f"SELECT {IDENTITY_COLS} FROM identities WHERE did = ANY($1::text[])", list(dids)
        )
        return {r[0]: identity_from_row(r) for r in rows}

    async def write_identities(self, writes: Sequence[IdentityWrite]) -> None:
        if not writes:
            return
        columns = list(zip(*(identity_row(w) for w in writes), strict=True))
        await self._pool.execute(_SQL_PUT_IDENTITIES, *columns)

    # -- hosts -------------------------------------------------------------------------------
    async def list_repos_by_collection(self, collection: str, after_did: str | None = None,
                                       limit: int = 500) -> list[str]:
        rows = await self._pool.fetch(_SQL_REPOS_BY_COLLECTION, collection, after_did or "", limit)
        return [r[0] for r in rows]

    async def collection_counts(self, did: str) -> dict[str, int]:
        rows = await self._pool.fetch("SELECT collection, records FROM repo_collections WHERE did = $1", did)
        return {r[0]: int(r[1]) for r in rows}

    async def get_host(self, hostname: str) -> HostState | None:
        row = await self._pool.fetchrow(f"SELECT {_HOST_COLS} FROM hosts WHERE hostname = $1", hostname)
        return None if row is None else _host(row)

    async def list_hosts(self, after: str | None = None, limit: int = 500) -> list[HostState]:
        rows = await self._pool.fetch(
            f"SELECT {_HOST_COLS} FROM hosts WHERE hostname > $1 ORDER BY hostname LIMIT $2",
            after or "",
            limit,
        )
        return [_host(r) for r in rows]

    async def upsert_host(self, host: HostState) -> None:
        await self._pool.execute(
            f"INSERT INTO hosts ({_HOST_COLS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13) "
            "ON CONFLICT (hostname) DO UPDATE SET status = EXCLUDED.status, "
            "account_limit = EXCLUDED.account_limit, trusted = EXCLUDED.trusted, "
            "rate_limit_per_second = EXCLUDED.rate_limit_per_second, "
            "rate_limit_per_hour = EXCLUDED.rate_limit_per_hour, "
            "rate_limit_per_day = EXCLUDED.rate_limit_per_day, "
            "last_seen = COALESCE(EXCLUDED.last_seen, hosts.last_seen), "
            "is_relay = EXCLUDED.is_relay, lenient_sync = EXCLUDED.lenient_sync",
            host.hostname,
            host.status,
            host.cursor,
            host.account_limit,
            host.trusted,
            host.rate_limit_per_second,
            host.rate_limit_per_hour,
            host.rate_limit_per_day,
            host.last_seen,
            host.account_count,
            host.created_at or time.time(),
            host.relay,
            host.lenient,
        )

    async def set_host_status(self, hostname: str, status: str) -> bool:
        result = await self._pool.execute(
            "UPDATE hosts SET status = $2 WHERE hostname = $1", hostname, status
        )
        return result == "UPDATE 1"

    async def host_cursor(self, hostname: str) -> int | None:
        return await self._pool.fetchval("SELECT upstream_cursor FROM hosts WHERE hostname = $1", hostname)

    async def set_host_cursor(self, hostname: str, cursor: int) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM upstream_done WHERE host = $1", hostname)
            result = await conn.execute(
                "UPDATE hosts SET upstream_cursor = $2 WHERE hostname = $1", hostname, cursor
            )
        return bool(result == "UPDATE 1")

    async def upstream_done_above(self, hostname: str, cursor: int) -> list[int]:
        await self._pool.execute("DELETE FROM upstream_done WHERE host = $1 AND upstream_seq <= $2", hostname, cursor)
        rows = await self._pool.fetch(
            "SELECT upstream_seq FROM upstream_done WHERE host = $1 ORDER BY upstream_seq", hostname)
        return [r[0] for r in rows]

    # -- domain bans -------------------------------------------------------------------------
    async def list_domain_bans(self) -> list[str]:
        return [r[0] for r in await self._pool.fetch("SELECT domain FROM domain_bans ORDER BY domain")]

    async def add_domain_ban(self, domain: str) -> bool:
        result = await self._pool.execute(
            "INSERT INTO domain_bans (domain, created_at) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            domain.strip().lower(),
            time.time(),
        )
        return result == "INSERT 0 1"

    # -- operator state ----------------------------------------------------------------------
    async def get_setting(self, key: str) -> str | None:
        return await self._pool.fetchval("SELECT value FROM relay_settings WHERE key = $1", key)

    async def set_setting(self, key: str, value: str) -> None:
        await self._pool.execute(
            "INSERT INTO relay_settings (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            key,
            value,
        )

    async def record_crawl_admission(self, hostname: str, at: float) -> None:
        await self._pool.execute(
            "INSERT INTO crawl_requests (hostname, result, requested_at) VALUES ($1, 'accepted', $2)", hostname, at
        )

    async def count_crawl_admissions(self, since: float) -> int:
        return await self._pool.fetchval(
            "SELECT count(*) FROM crawl_requests WHERE result = 'accepted' AND requested_at >= $1", since
        )

    async def record_admin_action(self, at: float, action: str, target: str, detail: str) -> None:
        await self._pool.execute(
            "INSERT INTO admin_audit (time, action, target, detail) VALUES ($1, $2, $3, $4)", at, action, target, detail
        )

    async def list_admin_actions(self, limit: int = 200) -> list[dict[str, Any]]:
        rows = await self._pool.fetch(
            "SELECT time, action, target, detail FROM admin_audit ORDER BY id DESC LIMIT $1", limit
        )
        return [audit_entry(*row) for row in reversed(rows)]

    async def remove_domain_ban(self, domain: str) -> bool:
        result = await self._pool.execute("DELETE FROM domain_bans WHERE domain = $1", domain.strip().lower())
        return result == "DELETE 1"

    async def pending_repairs(self, limit: int = 500, after_id: int = 0) -> list[dict[str, Any]]:
        rows = await self._pool.fetch(_numbered(PENDING_REPAIRS_SQL), after_id, limit)
        return [dict(row) for row in rows]

    async def mark_repair_consumed(self, row_id: int, at: float, seq: int | None, outcome: str) -> None:
        await self._pool.execute(_numbered(REPAIR_DONE_SQL), at, seq, outcome, row_id)


# `active` mirrors the account's two statuses (migration 0081's triggers), so a page is one
# index-only range scan of the partial index repo_collections_active_idx from the cursor to the
# limit, with no account lookup per row (a join's generic plan merge-joined against the whole
# accounts index: 161-440 ms at 100,000 accounts; a correlated lookup per row: 9.4 ms p99 for 2,000
# rows; this: 2.3 ms; bench/repos_by_collection.py and BENCHMARKS.md).
_SQL_REPOS_BY_COLLECTION = (
    "SELECT did FROM repo_collections WHERE collection = $1 AND did > $2 AND active ORDER BY did LIMIT $3"
)
# records = max(floor, records + delta), at least 1 for a row of an account whose counts are not
# exact (backfill.collections): update the rows that exist, insert the others (the single writer
# makes the two halves race-free)
_SQL_COLLECTION_DELTAS = """
WITH d AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS t(collection, did, delta, floor)),
up AS (
    UPDATE repo_collections r SET records = GREATEST(d.floor, r.records + d.delta,
        CASE WHEN EXISTS (SELECT 1 FROM repo_collections_exact e WHERE e.did = d.did) THEN 0 ELSE 1 END)
    FROM d WHERE r.collection = d.collection AND r.did = d.did
    RETURNING r.collection, r.did
)
INSERT INTO repo_collections (collection, did, records)
SELECT d.collection, d.did, GREATEST(d.floor, d.delta) FROM d
WHERE GREATEST(d.floor, d.delta) > 0
  AND NOT EXISTS (SELECT 1 FROM up WHERE up.collection = d.collection AND up.did = d.did)
"""
_SQL_COLLECTION_EMPTIED = (
    "DELETE FROM repo_collections r USING unnest($1::text[], $2::text[]) AS t(collection, did) "
    "WHERE r.collection = t.collection AND r.did = t.did AND r.records <= 0"
)


class _PgLease(WriterLease):
    """Advisory-lock holder; every batch goes through the same connection."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._stage_ready = False

    async def high_water(self) -> int:
        return await self._conn.fetchval("SELECT value FROM relay_meta WHERE key = 'seq_high_water'")

    async def commit_batch(self, batch: BatchWrite) -> None:
        async with self._conn.transaction():
            await self._advance_high_water(batch)
            await self._write_events(batch)
            await self._write_accounts(batch)
            await self._write_collections(batch)
            await self._write_hosts(batch)
            if batch.upstream_done:
                await self._conn.executemany(
                    "INSERT INTO upstream_done (host, upstream_seq) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    batch.upstream_done)

    async def _advance_high_water(self, batch: BatchWrite) -> None:
        status = await self._conn.execute(
            "UPDATE relay_meta SET value = $2 WHERE key = 'seq_high_water' AND value = $1",
            batch.expected_high_water,
            batch.new_high_water,
        )
        if status != "UPDATE 1":
            raise SequencerConflictError(
                f"seq high-water mark is no longer {batch.expected_high_water}: another writer"
            )

    async def _write_events(self, batch: BatchWrite) -> None:
        if not batch.events:
            return
        await self._conn.copy_records_to_table(
            "events", records=batch.events, columns=("seq", "did", "kind", "time", "frame")
        )
        await self._conn.execute(
            "UPDATE relay_meta SET value = value + $1 WHERE key = 'events_bytes'", batch.frame_bytes
        )

    async def _write_accounts(self, batch: BatchWrite) -> None:
        if not batch.accounts:
            return
        if not self._stage_ready:
            await self._conn.execute(_SQL_CREATE_STAGE)
            self._stage_ready = True
        accts = sorted(batch.accounts, key=lambda a: a.did)  # index order: fewer page jumps
        await self._conn.copy_records_to_table(
            _STAGE,
            schema_name="pg_temp",
            records=[account_row(a) for a in accts],
        )
        status = await self._conn.execute(_SQL_UPDATE_ACCOUNTS)
        if int(status.rsplit(" ", 1)[1]) < len(accts):
            await self._conn.execute(_SQL_INSERT_ACCOUNTS)

    async def _write_collections(self, batch: BatchWrite) -> None:
        """After the accounts (the lock order Spark's rebuild takes too: account row first)."""
        if batch.collection_resets:
            resets = batch.collection_resets
            rows = [(c, did, n) for did, counts in resets.items() for c, n in counts.items()]
            await self._conn.execute("DELETE FROM repo_collections WHERE did = ANY($1::text[])", list(resets))
            await self._conn.execute("INSERT INTO repo_collections_exact (did) SELECT unnest($1::text[]) "
                                     "ON CONFLICT (did) DO NOTHING", list(resets))
            if rows:
                await self._conn.execute(
                    "INSERT INTO repo_collections (collection, did, records) "
                    "SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
                    [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        deltas = batch.collection_deltas
        if deltas:
            columns = ([d[0] for d in deltas], [d[1] for d in deltas], [d[2] for d in deltas], [d[3] for d in deltas])
            await self._conn.execute(_SQL_COLLECTION_DELTAS, *columns)
            gone = [d for d in deltas if d[2] <= 0]
            if gone:
                await self._conn.execute(_SQL_COLLECTION_EMPTIED, [d[0] for d in gone], [d[1] for d in gone])

    async def _write_hosts(self, batch: BatchWrite) -> None:
        if not batch.host_updates:
            return
        hosts = list(batch.host_updates.items())
        await self._conn.execute(
            _SQL_UPDATE_HOSTS,
            [h for h, _ in hosts],
            [u[0] for _, u in hosts],
            [u[1] for _, u in hosts],
            [u[2] for _, u in hosts],
            time.time(),
        )

    async def release(self) -> None:
        if not self._conn.is_closed():
            try:
                await self._conn.close(timeout=5)
            except (TimeoutError, OSError, asyncpg.PostgresError):
                self._conn.terminate()
