"""Blocking ``sqlite3`` connections driven from asyncio: each connection is pinned to its own
single thread, and whole operations (many statements) run there in one hop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class SqliteConn:
    """One sqlite3 connection pinned to one thread."""

    def __init__(self, path: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._path = path
        self.conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self.run(self._open)

    def _open(self) -> None:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA busy_timeout = 30000")
        # Only takes effect while the file is still empty: 16 KB pages hold several 2-4 KB frames
        # each instead of one frame per 4 KB page.
        conn.execute("PRAGMA page_size = 16384")
        _enable_wal(conn, deadline=time.monotonic() + 30)
        conn.execute("PRAGMA synchronous = NORMAL")  # durable against process crashes in WAL mode
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("PRAGMA cache_size = -32000")
        self.conn = conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on the connection's thread."""
        return await self.run(lambda: fn(self.conn, *args))

    async def close(self) -> None:
        def _close() -> None:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

        try:
            await self.run(_close)
        finally:
            self._pool.shutdown(wait=False)


class Tx:
    """``with Tx(conn, immediate=True):`` BEGIN … COMMIT/ROLLBACK on an autocommit connection. An
    error inside propagates as it is, also when SQLite has already rolled the transaction back."""

    def __init__(self, conn: sqlite3.Connection, immediate: bool = True) -> None:
        self.conn = conn
        self.immediate = immediate

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE" if self.immediate else "BEGIN")
        return self.conn

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:  # SQLite may have rolled back already (a full disk, an I/O error)
            self.conn.execute("ROLLBACK")


def fetchall(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return conn.execute(sql, params).fetchall()


def fetchval(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def _enable_wal(conn: sqlite3.Connection, *, deadline: float) -> None:
    """Switch to WAL. Switching needs an exclusive lock and SQLite does not always apply the busy
    timeout to it (two processes opening a new database at once: "database is locked"), so retry."""
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
