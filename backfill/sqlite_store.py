"""SQLite backend: the embedded default. See ``backfill.store`` for each method's contract.

Each connection lives on its own single thread (``sqlite3`` is blocking); whole operations run
there, so one await costs one thread hop however many statements it takes. One writer
connection serialises writes inside this process; WAL mode lets reader connections replay while
it writes; ``busy_timeout`` covers other processes. The single-writer lease is an exclusive
``flock`` on ``<db>.writer.lock`` (released by the kernel if the process dies).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from backfill.errors import MigrationError, SequencerConflictError, SequencerLockedError
from backfill.identities import (
    FRESHER_ONLY,
    IDENTITY_COLS,
    Identity,
    IdentityWrite,
    identity_from_row,
    identity_row,
)
from backfill.migrations import discover, split_sqlite_statements
from backfill.sqlite_conn import SqliteConn, Tx, fetchall, fetchval
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

T = TypeVar("T")

_ACCOUNT_COLS = "did, host, upstream_status, local_status, rev, commit_cid, data_cid, sync_state, updated_at"
_HOST_COLS = (
    "hostname, status, upstream_cursor, account_limit, trusted, rate_limit_per_second, "
    "rate_limit_per_hour, rate_limit_per_day, last_seen, account_count, created_at, is_relay, lenient_sync"
)
_SQL_UPSERT_ACCOUNT_FROM_EVENT = (
    f"INSERT INTO accounts ({_ACCOUNT_COLS}) VALUES (?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (did) DO UPDATE SET host = excluded.host, upstream_status = excluded.upstream_status, "
    "local_status = excluded.local_status, rev = excluded.rev, commit_cid = excluded.commit_cid, data_cid = excluded.data_cid, "
    "sync_state = excluded.sync_state, updated_at = excluded.updated_at"
)
_SQL_UPDATE_HOST = (
    "INSERT INTO hosts (hostname, upstream_cursor, last_seen, account_count, created_at) "
    "VALUES (?, COALESCE(?, 0), ?, ?, ?) ON CONFLICT (hostname) DO UPDATE SET "
    "upstream_cursor = MAX(upstream_cursor, excluded.upstream_cursor), "
    "last_seen = COALESCE(excluded.last_seen, last_seen), "
    "account_count = account_count + excluded.account_count"
)


def _account(row: tuple[Any, ...]) -> AccountState:
    return AccountState(*row)


def _host(row: tuple[Any, ...]) -> HostState:
    values = list(row)
    values[4] = bool(values[4])
    values[11] = bool(values[11])
    values[12] = None if values[12] is None else bool(values[12])
    return HostState(*values)


class SqliteStore(Store):
    backend = "sqlite"

    def __init__(self, path: str, writer: SqliteConn, readers: list[SqliteConn]) -> None:
        self.path = path
        self._writer = writer
        self._readers = readers
        self._idle: asyncio.Queue[SqliteConn] = asyncio.Queue()
        for reader in readers:
            self._idle.put_nowait(reader)
        self._closed = False

    def is_transient(self, exc: BaseException) -> bool:
        """Busy/locked database or an I/O error (full disk, lost mount) are retried."""
        if isinstance(exc, sqlite3.OperationalError):
            text = str(exc).lower()
            return any(word in text for word in ("locked", "busy", "disk i/o", "unable to open", "full"))
        return super().is_transient(exc)

    @classmethod
    async def open(cls, path: str, *, readers: int = 2) -> SqliteStore:
        parent = Path(path).resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        writer = SqliteConn(path)
        await writer.open()
        conns = [SqliteConn(path) for _ in range(readers)]
        for conn in conns:
            await conn.open()
        return cls(path, writer, conns)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        conn = await self._idle.get()
        try:
            return await conn.call(fn, *args)
        finally:
            self._idle.put_nowait(conn)

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._writer.call(fn, *args)

    # -- lifecycle ---------------------------------------------------------------------------
    async def migrate(self) -> list[int]:
        migrations = discover("sqlite")

        def _migrate(conn: sqlite3.Connection) -> list[int]:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                " name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            applied: list[int] = []
            for migration in migrations:
                # BEGIN IMMEDIATE takes the database write lock: a concurrent runner waits here,
                # then sees the version recorded and skips it.
                with Tx(conn):
                    if fetchval(
                        conn, "SELECT 1 FROM schema_migrations WHERE version = ?", (migration.version,)
                    ):
                        continue
                    try:
                        for statement in split_sqlite_statements(migration.sql):
                            conn.execute(statement)
                    except sqlite3.Error as exc:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} failed: {exc}"
                        ) from exc
                    conn.execute(
                        "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                        (migration.version, migration.name, time.time()),
                    )
                applied.append(migration.version)
            return applied

        return await self._write(_migrate)

    async def applied_migrations(self) -> list[int]:
        rows = await self._read(fetchall, "SELECT version FROM schema_migrations ORDER BY version")
        return [r[0] for r in rows]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._writer.close()
        for reader in self._readers:
            await reader.close()

    async def acquire_writer(self, *, wait: bool = False, timeout: float | None = None) -> WriterLease:
        lock_path = self.path + ".writer.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                else:  # the holder's name, for a waiting process (writer_holder)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, writer_identity().encode(), 0)
                    return _SqliteLease(self, fd)
                if not wait or (deadline is not None and time.monotonic() >= deadline):
                    raise SequencerLockedError(
                        f"another sequencer holds the write lock on {self.path}: only one relay "
                        f"process may write to a database; stop the other one or point this one elsewhere"
                    )
                await asyncio.sleep(0.2)
        except BaseException:
            os.close(fd)
            raise

    async def writer_holder(self) -> str | None:
        """The name the current holder wrote into ``<db>.writer.lock`` (None if the lock is free)."""
        lock_path = self.path + ".writer.lock"
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: read who holds it
                return os.pread(fd, 512, 0).decode(errors="replace").strip() or "unnamed process"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    # -- events ------------------------------------------------------------------------------
    async def read_after(self, cursor: int, limit: int = 1000) -> list[SequencedEvent]:
        rows = await self._read(
            fetchall,
            "SELECT seq, did, kind, time, frame FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
            (cursor, limit),
        )
        return [SequencedEvent(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def oldest_seq(self) -> int | None:
        return await self._read(fetchval, "SELECT seq FROM events ORDER BY seq LIMIT 1")

    async def latest_seq(self) -> int:
        return await self._read(fetchval, "SELECT value FROM relay_meta WHERE key = 'seq_high_water'")

    async def count_events(self) -> int:
        return await self._read(fetchval, "SELECT count(*) FROM events")

    async def events_bytes(self) -> int:
        return await self._read(fetchval, "SELECT value FROM relay_meta WHERE key = 'events_bytes'")

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

        def _trim_batch(conn: sqlite3.Connection) -> int:
            with Tx(conn):
                rows = fetchall(
                    conn, "SELECT seq, time, length(frame) FROM events ORDER BY seq LIMIT ?", (batch,)
                )
                if not rows:
                    conn.execute("UPDATE relay_meta SET value = 0 WHERE key = 'events_bytes'")
                    return 0
                excess = 0
                if max_bytes is not None:
                    stored = fetchval(conn, "SELECT value FROM relay_meta WHERE key = 'events_bytes'")
                    excess = max(0, stored - max_bytes)
                count, freed = retention_prefix(rows, cutoff, excess)
                if count:
                    conn.execute(
                        "DELETE FROM events WHERE seq >= ? AND seq <= ?", (rows[0][0], rows[count - 1][0])
                    )
                    conn.execute(
                        "UPDATE relay_meta SET value = MAX(0, value - ?) WHERE key = 'events_bytes'", (freed,)
                    )
                return count

        total = 0
        while True:
            count = await self._write(_trim_batch)
            total += count
            if count < batch:
                return total
            await asyncio.sleep(0)

    # -- accounts ----------------------------------------------------------------------------
    async def get_account(self, did: str) -> AccountState | None:
        rows = await self._read(fetchall, f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did = ?", (did,))
        return _account(rows[0]) if rows else None

    async def account_heads(self, dids: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
        wanted = list(dids)

        def _heads(conn: sqlite3.Connection) -> dict[str, tuple[str | None, str | None]]:
            out: dict[str, tuple[str | None, str | None]] = {}
            for i in range(0, len(wanted), 500):
                chunk = wanted[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for did, host, rev in conn.execute(
                    f"SELECT did, host, rev FROM accounts WHERE did IN ({marks})", chunk
                ):
                    out[did] = (host, rev)
            return out

        return await self._read(_heads) if wanted else {}

    async def get_accounts(self, dids: Iterable[str]) -> dict[str, AccountState]:
        wanted = list(dict.fromkeys(dids))

        def _get(conn: sqlite3.Connection) -> dict[str, AccountState]:
            out: dict[str, AccountState] = {}
            for i in range(0, len(wanted), 500):
                chunk = wanted[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for row in conn.execute(
                    f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did IN ({marks})", chunk
                ):
                    out[row[0]] = _account(row)
            return out

        return await self._read(_get) if wanted else {}

    async def upsert_account(self, state: AccountState) -> None:
        def _upsert(conn: sqlite3.Connection) -> None:
            with Tx(conn):
                row = conn.execute("SELECT host FROM accounts WHERE did = ?", (state.did,)).fetchone()
                conn.execute(
                    f"INSERT INTO accounts ({_ACCOUNT_COLS}) VALUES (?,?,?,?,?,?,?,?,?) "
                    "ON CONFLICT (did) DO UPDATE SET host = excluded.host, "
                    "upstream_status = excluded.upstream_status, local_status = excluded.local_status, "
                    "rev = excluded.rev, commit_cid = excluded.commit_cid, data_cid = excluded.data_cid, "
                    "sync_state = excluded.sync_state, updated_at = excluded.updated_at",
                    (
                        state.did,
                        state.host,
                        state.upstream_status,
                        state.local_status,
                        state.rev,
                        state.commit_cid,
                        state.data_cid,
                        state.sync_state,
                        state.updated_at or time.time(),
                    ),
                )
                now = time.time()
                for host, delta in host_count_deltas(
                    row is not None, row[0] if row else None, state.host
                ).items():
                    conn.execute(_SQL_UPDATE_HOST, (host, None, None, delta, now))

        await self._write(_upsert)

    async def list_accounts(self, after_did: str | None = None, limit: int = 500) -> list[AccountState]:
        rows = await self._read(
            fetchall,
            f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE did > ? ORDER BY did LIMIT ?",
            (after_did or "", limit),
        )
        return [_account(r) for r in rows]

    async def accounts_by_sync_state(
        self, state: str, limit: int = 500, *, after_did: str | None = None
    ) -> list[AccountState]:
        partial = " AND sync_state <> 'synced'" if state != "synced" else ""
        rows = await self._read(
            fetchall,
            f"SELECT {_ACCOUNT_COLS} FROM accounts WHERE sync_state = ?{partial} AND did > ? ORDER BY did LIMIT ?",
            (state, after_did or "", limit),
        )
        return [_account(r) for r in rows]

    async def count_accounts(self, host: str | None = None) -> int:
        if host is None:
            return await self._read(fetchval, "SELECT count(*) FROM accounts")
        return await self._read(fetchval, "SELECT count(*) FROM accounts WHERE host = ?", (host,))

    async def count_accounts_by_host(self, sync_state: str) -> dict[str, int]:
        rows = await self._read(
            fetchall, "SELECT host, count(*) FROM accounts WHERE sync_state = ? AND host IS NOT NULL GROUP BY host",
            (sync_state,))
        return {r[0]: int(r[1]) for r in rows}

    # -- persisted identities ----------------------------------------------------------------
    async def get_identities(self, dids: Iterable[str]) -> dict[str, Identity | None]:
        wanted = list(dict.fromkeys(dids))

        def _get(conn: sqlite3.Connection) -> dict[str, Identity | None]:
            out: dict[str, Identity | None] = {}
            for i in range(0, len(wanted), 500):
                chunk = wanted[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for row in conn.execute(f"SELECT {IDENTITY_COLS} FROM identities WHERE did IN ({marks})", chunk):
                    out[row[0]] = identity_from_row(row)
            return out

        return await self._read(_get) if wanted else {}

    async def write_identities(self, writes: Sequence[IdentityWrite]) -> None:
        rows = [identity_row(w) for w in writes]

        def _put(conn: sqlite3.Connection) -> None:
            with Tx(conn):
                conn.executemany(f"INSERT INTO identities ({IDENTITY_COLS}) VALUES (?,?,?,?,?,?,?) {FRESHER_ONLY}", rows)

        if rows:
            await self._write(_put)

    # -- hosts -------------------------------------------------------------------------------
    async def list_repos_by_collection(self, collection: str, after_did: str | None = None,
                                       limit: int = 500) -> list[str]:
        rows = await self._read(fetchall, _SQL_REPOS_BY_COLLECTION, (collection, after_did or "", limit))
        return [r[0] for r in rows]

    async def collection_counts(self, did: str) -> dict[str, int]:
        rows = await self._read(fetchall, "SELECT collection, records FROM repo_collections WHERE did = ?", (did,))
        return {r[0]: int(r[1]) for r in rows}

    async def get_host(self, hostname: str) -> HostState | None:
        rows = await self._read(fetchall, f"SELECT {_HOST_COLS} FROM hosts WHERE hostname = ?", (hostname,))
        return _host(rows[0]) if rows else None

    async def list_hosts(self, after: str | None = None, limit: int = 500) -> list[HostState]:
        rows = await self._read(
            fetchall,
            f"SELECT {_HOST_COLS} FROM hosts WHERE hostname > ? ORDER BY hostname LIMIT ?",
            (after or "", limit),
        )
        return [_host(r) for r in rows]

    async def upsert_host(self, host: HostState) -> None:
        def _upsert(conn: sqlite3.Connection) -> None:
            conn.execute(
                f"INSERT INTO hosts ({_HOST_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT (hostname) DO UPDATE SET status = excluded.status, "
                "account_limit = excluded.account_limit, trusted = excluded.trusted, "
                "rate_limit_per_second = excluded.rate_limit_per_second, "
                "rate_limit_per_hour = excluded.rate_limit_per_hour, "
                "rate_limit_per_day = excluded.rate_limit_per_day, "
                "last_seen = COALESCE(excluded.last_seen, last_seen), "
                "is_relay = excluded.is_relay, lenient_sync = excluded.lenient_sync",
                (
                    host.hostname,
                    host.status,
                    host.cursor,
                    host.account_limit,
                    int(host.trusted),
                    host.rate_limit_per_second,
                    host.rate_limit_per_hour,
                    host.rate_limit_per_day,
                    host.last_seen,
                    host.account_count,
                    host.created_at or time.time(),
                    int(host.relay),
                    None if host.lenient is None else int(host.lenient),
                ),
            )

        await self._write(_upsert)

    async def _update_one(self, sql: str, params: tuple[Any, ...]) -> bool:
        return await self._write(lambda conn: conn.execute(sql, params).rowcount == 1)

    async def set_host_status(self, hostname: str, status: str) -> bool:
        return await self._update_one("UPDATE hosts SET status = ? WHERE hostname = ?", (status, hostname))

    async def host_cursor(self, hostname: str) -> int | None:
        return await self._read(fetchval, "SELECT upstream_cursor FROM hosts WHERE hostname = ?", (hostname,))

    async def set_host_cursor(self, hostname: str, cursor: int) -> bool:
        def _reset(conn: sqlite3.Connection) -> bool:
            with Tx(conn):
                conn.execute("DELETE FROM upstream_done WHERE host = ?", (hostname,))
                return conn.execute("UPDATE hosts SET upstream_cursor = ? WHERE hostname = ?",
                                    (cursor, hostname)).rowcount == 1

        return await self._write(_reset)

    async def upstream_done_above(self, hostname: str, cursor: int) -> list[int]:
        def _above(conn: sqlite3.Connection) -> list[int]:
            with Tx(conn):
                conn.execute("DELETE FROM upstream_done WHERE host = ? AND upstream_seq <= ?", (hostname, cursor))
                rows = conn.execute("SELECT upstream_seq FROM upstream_done WHERE host = ? ORDER BY upstream_seq",
                                    (hostname,)).fetchall()
            return [r[0] for r in rows]

        return await self._write(_above)

    # -- domain bans -------------------------------------------------------------------------
    async def list_domain_bans(self) -> list[str]:
        return [r[0] for r in await self._read(fetchall, "SELECT domain FROM domain_bans ORDER BY domain")]

    async def add_domain_ban(self, domain: str) -> bool:
        return await self._update_one(
            "INSERT INTO domain_bans (domain, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (domain.strip().lower(), time.time()),
        )

    async def remove_domain_ban(self, domain: str) -> bool:
        return await self._update_one("DELETE FROM domain_bans WHERE domain = ?", (domain.strip().lower(),))

    # -- operator state ----------------------------------------------------------------------
    async def get_setting(self, key: str) -> str | None:
        return await self._read(fetchval, "SELECT value FROM relay_settings WHERE key = ?", (key,))

    async def set_setting(self, key: str, value: str) -> None:
        await self._update_one(
            "INSERT INTO relay_settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    async def record_crawl_admission(self, hostname: str, at: float) -> None:
        await self._update_one(
            "INSERT INTO crawl_requests (hostname, result, requested_at) VALUES (?, 'accepted', ?)", (hostname, at)
        )

    async def count_crawl_admissions(self, since: float) -> int:
        return await self._read(
            fetchval, "SELECT count(*) FROM crawl_requests WHERE result = 'accepted' AND requested_at >= ?", (since,)
        )

    async def record_admin_action(self, at: float, action: str, target: str, detail: str) -> None:
        await self._update_one(
            "INSERT INTO admin_audit (time, action, target, detail) VALUES (?, ?, ?, ?)", (at, action, target, detail)
        )

    async def list_admin_actions(self, limit: int = 200) -> list[dict[str, Any]]:
        rows = await self._read(
            fetchall, "SELECT time, action, target, detail FROM admin_audit ORDER BY id DESC LIMIT ?", (limit,)
        )
        return [audit_entry(*row) for row in reversed(rows)]

    async def pending_repairs(self, limit: int = 500, after_id: int = 0) -> list[dict[str, Any]]:
        def run(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            cur = conn.execute(PENDING_REPAIRS_SQL, (after_id, limit))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

        return await self._read(run)

    async def mark_repair_consumed(self, row_id: int, at: float, seq: int | None, outcome: str) -> None:
        await self._update_one(REPAIR_DONE_SQL, (at, seq, outcome, row_id))


def _advance_high_water(conn: sqlite3.Connection, batch: BatchWrite) -> None:
    cur = conn.execute(
        "UPDATE relay_meta SET value = ? WHERE key = 'seq_high_water' AND value = ?",
        (batch.new_high_water, batch.expected_high_water),
    )
    if cur.rowcount != 1:
        raise SequencerConflictError(
            f"seq high-water mark is no longer {batch.expected_high_water}: another writer"
        )


def _write_events(conn: sqlite3.Connection, batch: BatchWrite) -> None:
    if batch.events:
        conn.executemany(
            "INSERT INTO events (seq, did, kind, time, frame) VALUES (?, ?, ?, ?, ?)", batch.events
        )
        conn.execute(
            "UPDATE relay_meta SET value = value + ? WHERE key = 'events_bytes'", (batch.frame_bytes,)
        )


def _write_accounts(conn: sqlite3.Connection, batch: BatchWrite) -> None:
    if batch.accounts:
        conn.executemany(
            _SQL_UPSERT_ACCOUNT_FROM_EVENT,
            [account_row(a) for a in batch.accounts],
        )


_SQL_REPOS_BY_COLLECTION = (
    # `active` mirrors the account's two statuses (migration 0081's triggers): one range scan of
    # the table's primary key (WITHOUT ROWID: the row is in the index), filtered on `active`, no account lookup per row
    "SELECT did FROM repo_collections WHERE collection = ? AND did > ? AND active ORDER BY did LIMIT ?"
)


def _write_collections(conn: sqlite3.Connection, batch: BatchWrite) -> None:
    for did, counts in batch.collection_resets.items():
        conn.execute("DELETE FROM repo_collections WHERE did = ?", (did,))
        conn.executemany("INSERT INTO repo_collections (collection, did, records) VALUES (?, ?, ?)",
                         [(c, did, n) for c, n in counts.items()])
        conn.execute("INSERT INTO repo_collections_exact (did) VALUES (?) ON CONFLICT (did) DO NOTHING", (did,))
    if batch.collection_deltas:
        # an account whose counts are not exact keeps a collection it has a row for: the records
        # its deletes name may be ones the relay never counted (see backfill.collections)
        conn.executemany(
            "INSERT INTO repo_collections (collection, did, records) VALUES (?1, ?2, max(?4, ?3)) "
            "ON CONFLICT (collection, did) DO UPDATE SET records = max(?4, records + ?3, "
            "CASE WHEN EXISTS (SELECT 1 FROM repo_collections_exact e WHERE e.did = ?2) THEN 0 ELSE 1 END)",
            batch.collection_deltas,
        )
        conn.executemany(
            "DELETE FROM repo_collections WHERE collection = ? AND did = ? AND records <= 0",
            [(c, d) for c, d, delta, _ in batch.collection_deltas if delta <= 0],
        )


def _write_hosts(conn: sqlite3.Connection, batch: BatchWrite) -> None:
    if batch.host_updates:
        now = time.time()
        conn.executemany(_SQL_UPDATE_HOST, [(h, c, s, d, now) for h, (c, s, d) in batch.host_updates.items()])


class _SqliteLease(WriterLease):
    def __init__(self, store: SqliteStore, fd: int) -> None:
        self._store = store
        self._fd: int | None = fd

    async def high_water(self) -> int:
        return await self._store._write(fetchval, "SELECT value FROM relay_meta WHERE key = 'seq_high_water'")

    async def commit_batch(self, batch: BatchWrite) -> None:
        if self._fd is None:
            raise SequencerConflictError("writer lease already released")

        def _commit(conn: sqlite3.Connection) -> None:
            with Tx(conn):
                _advance_high_water(conn, batch)
                _write_events(conn, batch)
                _write_accounts(conn, batch)
                _write_collections(conn, batch)
                _write_hosts(conn, batch)
                if batch.upstream_done:
                    conn.executemany("INSERT INTO upstream_done (host, upstream_seq) VALUES (?, ?) "
                                     "ON CONFLICT DO NOTHING", batch.upstream_done)

        await self._store._write(_commit)

    async def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
