"""Helpers for the relay tests: run an ASGI app (or a whole relay) on 127.0.0.1 with an ephemeral port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from backfill.store import Store
from firehose.frames import decode_frame
from firehose.state import Fence, PendingEvent, SequencedEvent
from firehose.subscriber import UpstreamFrame
from firehose.uvicorn_batch import BatchingWebSocketsProtocol
from relay.config import RelayConfig
from relay.ingest.lanes import Work
from relay.service import RelayService
from relay.ssrf import Resolver
from sim.host import SimHost


@dataclass
class RunningRelay:
    service: RelayService
    url: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/xrpc/com.atproto.sync.subscribeRepos"


@contextlib.asynccontextmanager
async def running_relay(*, resolver: Resolver | None = None, store: Store | None = None,
                        **settings: Any) -> AsyncIterator[RunningRelay]:
    """A relay in this process (``settings``: ``RelayConfig`` fields; ``database_url`` required),
    serving on 127.0.0.1:<ephemeral>."""
    raw = {"bind": "127.0.0.1:0", **settings}
    config = RelayConfig.from_values({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in raw.items()})
    service = RelayService(config, resolver=resolver, store=store)
    await service.start()
    try:
        async with serve_asgi(service.build_app()) as url:
            yield RunningRelay(service, url)
    finally:
        await service.stop()


@contextlib.asynccontextmanager
async def serve_asgi(app: ASGIApp, sock: socket.socket | None = None) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1:<ephemeral> (or on ``sock``, bound by the caller, whose port it
    then knows before the app exists); yields ``http://127.0.0.1:PORT``. The socket is closed after."""
    sock = sock or bound_socket()
    port = sock.getsockname()[1]
    # the protocol `relay serve` uses (uvicorn's sans-I/O WebSocket + batched subscribeRepos sends)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", ws=BatchingWebSocketsProtocol,
                            ws_per_message_deflate=False, server_header=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started, "test server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def bound_socket() -> socket.socket:
    """A TCP socket bound to 127.0.0.1:<ephemeral> (for ``serve_asgi``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def drop_schema_and_stream(pg_dsn: str, schema: str, redis_url: str, stream: str) -> None:
    """Remove what a scale-out test created on the shared servers: its schema and its stream."""
    import asyncpg
    import redis.asyncio as aioredis

    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()
    client = aioredis.from_url(redis_url)
    await client.delete(stream)
    await client.aclose()


# -- driving the lanes as a host run does (for orders a live connection cannot pin down) --------
def logged_frames(host: SimHost) -> list[UpstreamFrame]:
    """Every frame the simulated ``host`` has published, as its relay run would read them."""
    return [UpstreamFrame(host.hostname, e.seq, decode_frame(e.frame), e.frame) for e in host.log.entries]


def lane_work(hostname: str, uf: UpstreamFrame, did: str, *, relay: bool = False) -> Work:
    """``uf`` as the run of upstream ``hostname`` (a relay upstream if ``relay``) hands it to the lanes."""
    judged: asyncio.Future[PendingEvent | None] = asyncio.get_running_loop().create_future()
    return Work(hostname, uf, uf.frame.t or "", did, time.monotonic(), Fence(), judged, relay=relay)


async def judge(relay: RunningRelay, work: Work) -> PendingEvent | None:
    """Submit ``work`` to ``relay``'s lanes; the event it became (not yet handed to the sequencer)."""
    assert relay.service.lanes is not None
    relay.service.lanes.submit(work)
    return await work.judged


async def sequence(relay: RunningRelay, event: PendingEvent | None) -> SequencedEvent | None:
    """Hand an accepted event to the sequencer as its host run would; its stored form, once stored."""
    lanes, sequencer = relay.service.lanes, relay.service.sequencer
    assert event is not None and lanes is not None and sequencer is not None
    fut = await sequencer.enqueue(event)
    fut.add_done_callback(lambda f: lanes.settled(event, f))
    return await fut
