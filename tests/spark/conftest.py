"""Fixtures for the Spark job tests: one local[2] SparkSession for the whole run, a simulated PDS
fleet running on its own event-loop thread (Spark's Python workers fetch from it over HTTP), and
a freshly migrated relay database (a private PostgreSQL schema) seeded from the fleet's state."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from backfill.backends import open_store
from tests.spark.helpers import FleetThread


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    from spark.session import build_session

    session = build_session("local[2]", app_name="relay-spark-tests", progress_bar=False, ui=False,
                            shuffle_partitions=2)
    yield session
    session.stop()


@pytest.fixture
def fleet() -> Iterator[FleetThread]:
    ft = FleetThread(hosts=2, accounts_per_host=10, seed=7)
    try:
        yield ft
    finally:
        ft.stop()


@pytest.fixture
def relay_db(pg_dsn: str) -> Iterator[str]:
    """URL of a freshly migrated relay database in a private schema (dropped afterwards)."""
    schema = f"spark_t_{uuid.uuid4().hex[:10]}"
    url = f"{pg_dsn}?schema={schema}"

    async def migrate() -> None:
        store = await open_store(url)
        try:
            await store.migrate()
        finally:
            await store.close()

    asyncio.run(migrate())
    try:
        yield url
    finally:
        async def drop() -> None:
            conn = await asyncpg.connect(pg_dsn)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()

        asyncio.run(drop())
