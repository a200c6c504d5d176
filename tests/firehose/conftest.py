"""Fixtures for the firehose tests: real stores (SQLite file, Postgres schema), real buses, and
an ``Ingest`` helper that writes events the way the sequencer does (writer lease + one batch per
transaction) and only then publishes them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from backfill.backends import open_store
from backfill.store import BatchWrite, Store
from firehose.bus import EventBus, InProcessBus
from firehose.frames import encode_frame
from firehose.state import SequencedEvent

DID = "did:plc:testaccount0000000000000"


def commit_frame(seq: int, payload: bytes = b"x" * 64) -> bytes:
    return encode_frame("#commit", {"seq": seq, "repo": DID, "blocks": payload, "time": "2026-01-01T00:00:00Z"})


class Ingest:
    """Writes numbered events into a real store, then publishes them on the bus."""

    def __init__(self, store: Store, bus: EventBus) -> None:
        self.store = store
        self.bus = bus
        self.lease = None
        self.seq = 0

    async def add(self, n: int, *, batch: int = 10, when: float | None = None, payload: bytes = b"x" * 64) -> None:
        if self.lease is None:
            self.lease = await self.store.acquire_writer(wait=True, timeout=10)
            self.seq = await self.lease.high_water()
        done = 0
        while done < n:
            k = min(batch, n - done)
            events = []
            for _ in range(k):
                self.seq += 1
                events.append(SequencedEvent(self.seq, DID, "#commit", when or time.time(), commit_frame(self.seq, payload)))
            bw = BatchWrite(
                expected_high_water=self.seq - k,
                new_high_water=self.seq,
                events=[(e.seq, e.did, e.kind, e.time, e.frame) for e in events],
            )
            await self.lease.commit_batch(bw)
            await self.bus.publish(events)
            done += k
            await asyncio.sleep(0)

    async def close(self) -> None:
        if self.lease is not None:
            await self.lease.release()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, pg_dsn: str) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        s = await open_store(str(tmp_path / "relay.sqlite"))
        await s.migrate()
        yield s
        await s.close()
        return
    schema = "fh_" + uuid.uuid4().hex[:12]
    s = await open_store(pg_dsn, schema=schema)
    await s.migrate()
    yield s
    await s.close()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.fixture
async def ingest(store: Store) -> AsyncIterator[Ingest]:
    ing = Ingest(store, InProcessBus())
    yield ing
    await ing.close()
