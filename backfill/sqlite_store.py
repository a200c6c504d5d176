"""SQLite backend: the embedded default. See ``backfill.store`` for each method's contract and
``backfill.sql_store`` for the half shared with PostgreSQL; this module keeps SQLite's dialect.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from backfill.errors import MigrationError, SequencerConflictError, SequencerLockedError
from backfill.identities import FRESHER_ONLY, IDENTITY_COLS, IdentityWrite, identity_row
from backfill.migrations import discover, split_sqlite_statements
from backfill.sql_store import UPSERT_ACCOUNT_SQL, SqlStore
from backfill.sqlite_conn import SqliteConn, Tx, fetchall, fetchval
from backfill.store import (
    BatchWrite,
    WriterLease,
    host_count_deltas,
    retention_prefix,
    writer_identity,
)
from firehose.state import AccountState, account_row

T = TypeVar("T")

_SQL_UPDATE_HOST = (
    "INSERT INTO hosts (hostname, upstream_cursor, last_seen, account_count, created_at) "
    "VALUES (?, COALESCE(?, 0), ?, ?, ?) ON CONFLICT (hostname) DO UPDATE SET "
    "upstream_cursor = MAX(upstream_cursor, excluded.upstream_cursor), "
    "last_seen = COALESCE(excluded.last_seen, last_seen), "
    "account_count = account_count + excluded.account_count"
)


class SqliteStore(SqlStore):
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

    # -- the dialect's primitives (see backfill.sql_store) ------------------------------------
    async def _fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return await self._read(fetchall, sql, args)

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        return await self._read(fetchval, sql, args)

    async def _execute(self, sql: str, *args: Any) -> int:
        return await self._write(lambda conn: conn.execute(sql, args).rowcount)

    async def _fetch_in(self, select: str, column: str, keys: list[str]) -> list[tuple[Any, ...]]:
        def _chunks(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
            rows: list[tuple[Any, ...]] = []
            for i in range(0, len(keys), 500):  # below SQLite's limit of bound parameters
                chunk = keys[i : i + 500]
                rows += conn.execute(f"{select} WHERE {column} IN ({','.join('?' * len(chunk))})", chunk).fetchall()
            return rows

        return await self._read(_chunks)

    async def _trim_step(self, batch: int, cutoff: float | None, max_bytes: int | None) -> int:
        def _step(conn: sqlite3.Connection) -> int:
            with Tx(conn):
                rows = fetchall(conn, "SELECT seq, time, length(frame) FROM events ORDER BY seq LIMIT ?", (batch,))
                if not rows:  # empty window (maybe emptied by hand): the byte counter restarts
                    conn.execute("UPDATE relay_meta SET value = 0 WHERE key = 'events_bytes'")
                    return 0
                excess = 0
                if max_bytes is not None:
                    stored = fetchval(conn, "SELECT value FROM relay_meta WHERE key = 'events_bytes'")
                    excess = max(0, stored - max_bytes)
                count, freed = retention_prefix(rows, cutoff, excess)
                if count:
                    conn.execute("DELETE FROM events WHERE seq >= ? AND seq <= ?", (rows[0][0], rows[count - 1][0]))
                    conn.execute("UPDATE relay_meta SET value = MAX(0, value - ?) WHERE key = 'events_bytes'", (freed,))
                return count

        return await self._write(_step)

    # -- the multi-statement writes ----------------------------------------------------------
    async def upsert_account(self, state: AccountState) -> None:
        def _upsert(conn: sqlite3.Connection) -> None:
            with Tx(conn):
                row = conn.execute("SELECT host FROM accounts WHERE did = ?", (state.did,)).fetchone()
                conn.execute(UPSERT_ACCOUNT_SQL, (*account_row(state)[:8], state.updated_at or time.time()))
                now = time.time()
                for host, delta in host_count_deltas(row is not None, row[0] if row else None, state.host).items():
                    conn.execute(_SQL_UPDATE_HOST, (host, None, None, delta, now))

        await self._write(_upsert)

    async def write_identities(self, writes: Sequence[IdentityWrite]) -> None:
        rows = [identity_row(w) for w in writes]

        def _put(conn: sqlite3.Connection) -> None:
            with Tx(conn):
                conn.executemany(f"INSERT INTO identities ({IDENTITY_COLS}) VALUES (?,?,?,?,?,?,?) {FRESHER_ONLY}", rows)

        if rows:
            await self._write(_put)

    async def set_host_cursor(self, hostname: str, cursor: int) -> bool:
        def _reset(conn: sqlite3.Connection) -> bool:
            with Tx(conn):
                conn.execute("DELETE FROM upstream_done WHERE host = ?", (hostname,))
                return conn.execute("UPDATE hosts SET upstream_cursor = ? WHERE hostname = ?",
                                    (cursor, hostname)).rowcount == 1

        return await self._write(_reset)


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
            UPSERT_ACCOUNT_SQL,
            [account_row(a) for a in batch.accounts],
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
