"""Synchronous access to the relay database from the Spark driver and executors.

Contract: ``connect_db(url) -> JobDB``. ``postgresql://``/``postgres://`` URLs use asyncpg (on a
private event loop, so callers stay synchronous inside Spark tasks); anything else is a SQLite
path (``sqlite:///path`` or a bare path), the relay's embedded default. A ``schema=`` query
parameter on a Postgres URL selects the schema, as for ``backfill.backends.open_store``. SQL is written once with
``?`` placeholders and rewritten to ``$n`` for PostgreSQL. Rows come back as dicts.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_PLACEHOLDER = re.compile(r"\?")


def is_postgres(url: str | None) -> bool:
    return bool(url) and str(url).startswith(("postgresql://", "postgres://"))


def sqlite_path(url: str | None) -> str:
    """The SQLite file for a non-Postgres URL, exactly as the relay's store reads it."""
    from backfill.store import sqlite_path_from_url

    return sqlite_path_from_url(url)


def split_schema(url: str) -> tuple[str, str | None]:
    """Split a ``schema=`` query parameter (the relay store's convention) off a Postgres URL."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((value for key, value in query if key == "schema" and value), None)
    rest = [(key, value) for key, value in query if key != "schema"]
    return urlunsplit(parts._replace(query=urlencode(rest))), schema


def to_dollar(sql: str) -> str:
    """Rewrite ``?`` placeholders as ``$1, $2, …`` (no ``?`` may appear inside literals)."""
    counter = iter(range(1, 10_000))
    return _PLACEHOLDER.sub(lambda _m: f"${next(counter)}", sql)


class JobDB:
    """One connection; ``transaction()`` groups writes atomically."""

    def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def execute(self, sql: str, *args: Any) -> None:
        raise NotImplementedError

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        raise NotImplementedError

    @contextmanager
    def transaction(self) -> Iterator[JobDB]:
        raise NotImplementedError
        yield self

    def close(self) -> None:
        raise NotImplementedError

    def fetchval(self, sql: str, *args: Any) -> Any:
        rows = self.fetch(sql, *args)
        return next(iter(rows[0].values())) if rows else None

    def __enter__(self) -> JobDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PostgresDB(JobDB):
    def __init__(self, url: str) -> None:
        import asyncpg

        dsn, schema = split_schema(url)
        settings = {"application_name": "relay-spark"}
        if schema:
            settings["search_path"] = schema
        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(dsn, server_settings=settings))
        self._tx_depth = 0

    def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        rows = self.loop.run_until_complete(self.conn.fetch(to_dollar(sql), *args))
        return [dict(r) for r in rows]

    def execute(self, sql: str, *args: Any) -> None:
        self.loop.run_until_complete(self.conn.execute(to_dollar(sql), *args))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        batch = [tuple(r) for r in rows]
        if batch:
            self.loop.run_until_complete(self.conn.executemany(to_dollar(sql), batch))

    @contextmanager
    def transaction(self) -> Iterator[JobDB]:
        tx = self.conn.transaction()
        self.loop.run_until_complete(tx.start())
        try:
            yield self
        except BaseException:
            self.loop.run_until_complete(tx.rollback())
            raise
        else:
            self.loop.run_until_complete(tx.commit())

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.conn.close())
        finally:
            self.loop.close()


class SqliteDB(JobDB):
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=60.0, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA busy_timeout = 60000")

    def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(sql, args).fetchall()]

    def execute(self, sql: str, *args: Any) -> None:
        self.conn.execute(sql, args)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.conn.executemany(sql, [tuple(r) for r in rows])

    @contextmanager
    def transaction(self) -> Iterator[JobDB]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def connect_db(url: str | None) -> JobDB:
    """Open the relay database named by ``url`` (see the module docstring; None or empty → the
    relay's embedded default file)."""
    if url and is_postgres(url):
        return PostgresDB(url)
    return SqliteDB(sqlite_path(url))
