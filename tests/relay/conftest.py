"""Fixtures for the relay tests: a running in-process relay on SQLite or a fresh Postgres schema."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from backfill.store import Store
from relay.ssrf import Resolver
from sim.plc import SimPLC
from tests.relay.helpers import RunningRelay, running_relay

__all__ = ["RunningRelay", "database_url", "relay_factory"]


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path, pg_dsn: str) -> Any:
    """A database URL for one relay: a SQLite file, or a fresh schema on the local Postgres."""
    if request.param == "sqlite":
        yield str(tmp_path / "relay.sqlite")
        return
    schema = f"t_relay_{uuid.uuid4().hex[:12]}"
    yield f"{pg_dsn}?schema={schema}"

    async def drop() -> None:
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    import asyncio

    asyncio.new_event_loop().run_until_complete(drop())


RelayFactory = Callable[..., contextlib.AbstractAsyncContextManager[RunningRelay]]


@pytest.fixture
def relay_factory(tmp_path: Path) -> RelayFactory:
    """``async with relay_factory(database_url=…, **settings) as relay:`` runs a relay on 127.0.0.1."""

    def factory(*, resolver: Resolver | None = None, store: Store | None = None,
                **settings: Any) -> contextlib.AbstractAsyncContextManager[RunningRelay]:
        return running_relay(resolver=resolver, store=store,
                             **{"database_url": str(tmp_path / "relay.sqlite"), **settings})

    return factory


@pytest.fixture
async def plc() -> AsyncIterator[SimPLC]:
    """The simulator's PLC directory on its own (its ``requests`` count the resolutions)."""
    directory = SimPLC()
    await directory.start()
    yield directory
    await directory.stop()
