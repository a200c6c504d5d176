"""Fixtures for the backfill tests: a migrated store on each backend.

Postgres runs use the real server (``pg_dsn``), each test in a fresh schema that is dropped
afterwards; SQLite runs use a file in the test's tmp_path.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import cbrrr
import pytest

from backfill.backends import open_store
from backfill.store import Store

BACKENDS = ["sqlite", "postgres"]


def decode_frame(frame: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a wire frame into (header, body) — test-side decoder, independent of firehose/."""
    header, body = list(cbrrr.decode_multi_dag_cbor_in_violation_of_the_spec(frame))
    return header, body


class StoreTarget:
    """Where a test's store lives; ``open()`` gives a fresh connection to the same data."""

    def __init__(self, backend: str, url: str, schema: str | None) -> None:
        self.backend = backend
        self.url = url
        self.schema = schema

    @property
    def full_url(self) -> str:
        """One string usable by a subprocess (``?schema=`` for Postgres)."""
        return f"{self.url}?schema={self.schema}" if self.schema else self.url

    async def open(self, **kwargs: Any) -> Store:
        return await open_store(self.url, schema=self.schema, **kwargs)

    async def sql(self, statement: str) -> None:
        """Run raw SQL against the target (used to simulate operator actions like TRUNCATE)."""
        if self.backend == "postgres":
            conn = await asyncpg.connect(self.url, server_settings={"search_path": self.schema or "public"})
            try:
                await conn.execute(statement)
            finally:
                await conn.close()
        else:
            import sqlite3

            conn = sqlite3.connect(self.url, timeout=30)
            try:
                conn.execute(statement)
                conn.commit()
            finally:
                conn.close()


async def _pg_target(pg_dsn: str) -> AsyncIterator[StoreTarget]:
    schema = f"t_backfill_{uuid.uuid4().hex[:12]}"
    yield StoreTarget("postgres", pg_dsn, schema)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture(params=BACKENDS)
async def target(request: pytest.FixtureRequest, tmp_path: Path, pg_dsn: str) -> AsyncIterator[StoreTarget]:
    """A fresh database on each backend (SQLite file / Postgres schema)."""
    if request.param == "sqlite":
        yield StoreTarget("sqlite", str(tmp_path / "relay.sqlite"), None)
        return
    async for t in _pg_target(pg_dsn):
        yield t


@pytest.fixture
async def pg_target(pg_dsn: str) -> AsyncIterator[StoreTarget]:
    """A fresh Postgres schema, for the Postgres-only tests."""
    async for t in _pg_target(pg_dsn):
        yield t


@pytest.fixture
async def store(target: StoreTarget) -> AsyncIterator[Store]:
    s = await target.open()
    await s.migrate()
    yield s
    await s.close()
