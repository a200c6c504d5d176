"""Slow readers cost the relay at most their own byte budget each, whatever the stream sends.

Twelve consumers connect over real sockets (a 4 KiB receive buffer) and never read; one healthy
consumer reads everything. 40 MB of events then flow (1,200 frames of 32 KiB). Each stalled
consumer may hold ``live_queue_bytes`` (512 KiB here; ``RELAY_CONSUMER_MAX_QUEUE_BYTES``) of
events in the relay — queued, or in its socket's write buffer — plus the batch being written;
past it the relay cuts it with ``ConsumerTooSlow``. The lag limit is set far beyond the test, so
the byte bound alone does the cutting.

Memory is measured from outside the relay's own accounting: ``tracemalloc``'s peak over the
flood (every Python allocation of this process, which serves the consumers on both of the relay's
subscribeRepos listeners in turn: the plain ``websockets`` server and uvicorn with batched
sends). Without the bound, twelve stalled consumers hold up to twelve copies of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect

from backfill.backends import open_store
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from tests.firehose.conftest import Ingest
from tests.firehose.servers import serve, ws_url
from tests.firehose.test_broadcast import collect
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

STALLED = 12
FRAMES, BATCH, PAYLOAD = 1200, 10, 32 * 1024
LIMIT = 512 * 1024


@contextlib.asynccontextmanager
async def stalled_consumer(url: str) -> AsyncIterator[ClientConnection]:
    """A subscribeRepos connection that never reads (a 4 KiB receive buffer, reading paused)."""
    host, port = url.split("/")[2].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    async with connect(url, sock=sock, max_queue=1, max_size=None, ping_interval=None, close_timeout=0.1) as ws:
        ws.transport.pause_reading()
        try:
            yield ws
        finally:
            ws.transport.abort()  # a closing handshake would wait for a peer that never reads


@pytest.mark.parametrize("transport", ["websockets", "asgi-batch"])
async def test_stalled_consumers_hold_at_most_their_budget_each(transport: str, tmp_path: Path) -> None:
    store = await open_store(str(tmp_path / "relay.sqlite"))
    await store.migrate()
    ingest = Ingest(store, InProcessBus())
    b = Broadcaster(store, ingest.bus, live_queue_bytes=LIMIT, max_lag=3600.0)
    await b.start()
    try:
        async with serve(b, transport) as hp, contextlib.AsyncExitStack() as stack:
            for _ in range(STALLED):
                await stack.enter_async_context(stalled_consumer(ws_url(hp)))
            healthy = asyncio.create_task(collect(ws_url(hp), until_seq=FRAMES))
            await until(lambda: b.consumer_count == STALLED + 1, "every consumer to be registered")
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                await ingest.add(FRAMES, batch=BATCH, payload=b"s" * PAYLOAD)
                assert await asyncio.wait_for(healthy, 60) == list(range(1, FRAMES + 1))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            grew = peak - before
            stream = FRAMES * PAYLOAD
            # each stalled consumer: its budget and the batches being written; 4 MiB for the rest
            # (the frames in flight to the store and the healthy consumer)
            bound = STALLED * (LIMIT + 2 * BATCH * PAYLOAD) + (4 << 20)
            print(f"RESULT slow_readers transport={transport} stalled={STALLED} stream_mb={stream / 1e6:.1f} "
                  f"peak_growth_mb={grew / 1e6:.1f} bound_mb={bound / 1e6:.1f}")
            assert grew <= bound, f"{grew / 1e6:.1f} MB > {bound / 1e6:.1f} MB"
            # and each of them was cut (ConsumerTooSlow), not left holding its budget
            await until(lambda: b.stats.too_slow == STALLED, "every stalled consumer to be cut", timeout=60)
            await until(lambda: b.consumer_count == 0, "every consumer to be deregistered")
    finally:
        await b.close()
        await ingest.close()
        await store.close()
