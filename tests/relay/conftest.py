"""Fixtures for the relay tests: a running in-process relay on SQLite or a fresh Postgres schema."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from backfill.store import Store
from relay.config import RelayConfig
from relay.service import RelayService
from relay.sim.plc import SimPLC
from relay.ssrf import Resolver
from tests.relay.helpers import serve_asgi


@dataclass
class RunningRelay:
    service: RelayService
    url: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/xrpc/com.atproto.sync.subscribeRepos"


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

    @contextlib.asynccontextmanager
    async def factory(*, resolver: Resolver | None = None, store: Store | None = None,
                      **settings: Any) -> AsyncIterator[RunningRelay]:
        raw = {"database_url": str(tmp_path / "relay.sqlite"), "bind": "127.0.0.1:0", **settings}
        config = RelayConfig.from_values({k: str(v).lower() if isinstance(v, bool) else str(v)
                                          for k, v in raw.items()})
        service = RelayService(config, resolver=resolver, store=store)
        await service.start()
        try:
            async with serve_asgi(service.build_app()) as url:
                yield RunningRelay(service, url)
        finally:
            await service.stop()

    return factory


@pytest.fixture
async def plc() -> AsyncIterator[SimPLC]:
    """The simulator's PLC directory on its own (its ``requests`` count the resolutions)."""
    directory = SimPLC()
    await directory.start()
    yield directory
    await directory.stop()
