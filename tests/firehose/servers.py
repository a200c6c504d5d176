"""Start the subscribeRepos endpoint on 127.0.0.1 (ephemeral port) with either transport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from firehose.broadcast import Broadcaster
from firehose.serve_asgi import SUBSCRIBE_REPOS_PATH, subscribe_repos_routes
from firehose.serve_websockets import serve_subscribe_repos
from firehose.uvicorn_batch import BatchingWebSocketsProtocol


@contextlib.asynccontextmanager
async def serve_asgi(broadcaster: Broadcaster, *, batching: bool = False, deflate: bool = False) -> AsyncIterator[str]:
    """uvicorn + Starlette; ``batching`` uses the relay's protocol with the batched-send extension."""
    app = Starlette(routes=subscribe_repos_routes(broadcaster))
    ws: Any = BatchingWebSocketsProtocol if batching else "websockets-sansio"
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws=ws,
                           ws_per_message_deflate=deflate)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task


@contextlib.asynccontextmanager
async def serve_plain(broadcaster: Broadcaster, *, deflate: bool = False) -> AsyncIterator[str]:
    server = await serve_subscribe_repos(broadcaster, deflate=deflate)
    try:
        port = server.sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        async with asyncio.timeout(10):
            await server.wait_closed()


def serve(broadcaster: Broadcaster, transport: str, *, deflate: bool = False) -> contextlib.AbstractAsyncContextManager[str]:
    """``transport``: "asgi", "asgi-batch" (uvicorn with firehose.uvicorn_batch) or "websockets";
    ``deflate`` offers permessage-deflate (``RELAY_WS_DEFLATE``)."""
    if transport.startswith("asgi"):
        return serve_asgi(broadcaster, batching=transport == "asgi-batch", deflate=deflate)
    return serve_plain(broadcaster, deflate=deflate)


def ws_url(hostport: str, cursor: int | None = None) -> str:
    url = f"ws://{hostport}{SUBSCRIBE_REPOS_PATH}"
    return url if cursor is None else f"{url}?cursor={cursor}"
