"""Start the subscribeRepos endpoint on 127.0.0.1 (ephemeral port) with either transport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette

from firehose.broadcast import Broadcaster
from firehose.serve_asgi import SUBSCRIBE_REPOS_PATH, subscribe_repos_routes
from firehose.serve_websockets import serve_subscribe_repos


@contextlib.asynccontextmanager
async def serve_asgi(broadcaster: Broadcaster) -> AsyncIterator[str]:
    app = Starlette(routes=subscribe_repos_routes(broadcaster))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws="websockets-sansio",
                           ws_per_message_deflate=False)
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
async def serve_plain(broadcaster: Broadcaster) -> AsyncIterator[str]:
    server = await serve_subscribe_repos(broadcaster)
    try:
        port = server.sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        async with asyncio.timeout(10):
            await server.wait_closed()


def serve(broadcaster: Broadcaster, transport: str) -> contextlib.AbstractAsyncContextManager[str]:
    return serve_asgi(broadcaster) if transport == "asgi" else serve_plain(broadcaster)


def ws_url(hostport: str, cursor: int | None = None) -> str:
    url = f"ws://{hostport}{SUBSCRIBE_REPOS_PATH}"
    return url if cursor is None else f"{url}?cursor={cursor}"
