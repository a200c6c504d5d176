"""PostgreSQL backend (asyncpg). See ``backfill.store`` for the contract of every method and
``backfill.sql_store`` for the half shared with SQLite; this module keeps PostgreSQL's dialect.

Events are written with binary ``COPY`` inside the batch transaction; the frame column is
``STORAGE EXTERNAL`` (no compression attempts on CAR bytes). Locks are advisory locks keyed by
database and schema, so several relays (or tests) can share a server in separate schemas.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from backfill.errors import MigrationError, SequencerConflictError, SequencerLockedError
from backfill.identities import FRESHER_ONLY, IDENTITY_COLS, IdentityWrite, identity_row
from backfill.migrations import discover
from backfill.sql_store import ACCOUNT_COLS, UPSERT_ACCOUNT_SQL, SqlStore, keep_head_sql
from backfill.store import (
    BatchWrite,
    WriterLease,
    host_count_deltas,
    retention_prefix,
    writer_identity,
)
from firehose.state import AccountState, account_row

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@functools.lru_cache(maxsize=256)
def _numbered(sql: str) -> str:
    """A statement written with ``?`` placeholders (``backfill.sql_store``) in asyncpg's ``$n`` form."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], start=1))


def _changed(status: str) -> int:
    """Rows changed, from a command status such as ``UPDATE 1`` or ``INSERT 0 1``."""
    return int(status.rsplit(" ", 1)[1])


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
UPDATE accounts a SET host = s.host, upstream_status = s.upstream_status, local_status = s.local_status,
    {keep_head_sql("s", "a")}, sync_state = s.sync_state, updated_at = s.updated_at
FROM pg_temp.{_STAGE} s
WHERE a.did = s.did
"""
_SQL_INSERT_ACCOUNTS = f"""
INSERT INTO accounts ({ACCOUNT_COLS})
SELECT {ACCOUNT_COLS} FROM pg_temp.{_STAGE} s
WHERE NOT EXISTS (SELECT 1 FROM accounts a WHERE a.did = s.did)
ON CONFLICT (did) DO UPDATE SET
    host = EXCLUDED.host, upstream_status = EXCLUDED.upstream_status, local_status = EXCLUDED.local_status,
    {keep_head_sql("EXCLUDED", "accounts")}, sync_state = EXCLUDED.sync_state, updated_at = EXCLUDED.updated_at
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


class PostgresStore(SqlStore):
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

    # -- the dialect's primitives (see backfill.sql_store) ------------------------------------
    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return await self._pool.fetch(_numbered(sql), *args)

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        return await self._pool.fetchval(_numbered(sql), *args)

    async def _execute(self, sql: str, *args: Any) -> int:
        return _changed(await self._pool.execute(_numbered(sql), *args))

    async def _fetch_in(self, select: str, column: str, keys: list[str]) -> list[asyncpg.Record]:
        return await self._pool.fetch(f"{select} WHERE {column} = ANY($1::text[])", keys)

    async def _trim_step(self, batch: int, cutoff: float | None, max_bytes: int | None) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch("SELECT seq, time, octet_length(frame) FROM events ORDER BY seq LIMIT $1", batch)
            if not rows:  # empty window (maybe truncated by hand): the byte counter restarts
                await conn.execute("UPDATE relay_meta SET value = 0 WHERE key = 'events_bytes'")
                return 0
            excess = 0
            if max_bytes is not None:
                stored = await conn.fetchval("SELECT value FROM relay_meta WHERE key = 'events_bytes'")
                excess = max(0, stored - max_bytes)
            count, freed = retention_prefix(rows, cutoff, excess)
            if count:
                await conn.execute("DELETE FROM events WHERE seq >= $1 AND seq <= $2", rows[0][0], rows[count - 1][0])
                await conn.execute(
                    "UPDATE relay_meta SET value = GREATEST(0, value - $1) WHERE key = 'events_bytes'", freed
                )
            return count

    # -- the multi-statement writes ----------------------------------------------------------
    async def upsert_account(self, state: AccountState) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            old_host = await conn.fetchrow("SELECT host FROM accounts WHERE did = $1 FOR UPDATE", state.did)
            await conn.execute(_numbered(UPSERT_ACCOUNT_SQL), *account_row(state)[:8], state.updated_at or time.time())
            deltas = host_count_deltas(old_host is not None, old_host[0] if old_host else None, state.host)
            if deltas:
                nones = [None] * len(deltas)
                await conn.execute(_SQL_UPDATE_HOSTS, list(deltas), nones, nones, list(deltas.values()), time.time())

    async def write_identities(self, writes: Sequence[IdentityWrite]) -> None:
        if not writes:
            return
        columns = list(zip(*(identity_row(w) for w in writes), strict=True))
        await self._pool.execute(_SQL_PUT_IDENTITIES, *columns)

    async def set_host_cursor(self, hostname: str, cursor: int) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM upstream_done WHERE host = $1", hostname)
            result = await conn.execute("UPDATE hosts SET upstream_cursor = $2 WHERE hostname = $1", hostname, cursor)
        return _changed(result) == 1


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
