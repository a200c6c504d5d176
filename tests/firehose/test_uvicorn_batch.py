"""firehose.uvicorn_batch: the batched-send ASGI extension over a real uvicorn server and socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from websockets.asyncio.client import connect

from firehose.uvicorn_batch import SEND_BATCH, BatchingWebSocketsProtocol

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def _serve(app: Any, ws: Any) -> AsyncIterator[int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws=ws,
                                          ws_per_message_deflate=False))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_batch_goes_out_as_separate_messages_in_order() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["extensions"])
        await receive()  # websocket.connect
        with pytest.raises(RuntimeError):  # not before the accept
            await send({"type": SEND_BATCH, "frames": [b"early"]})
        await send({"type": "websocket.accept"})
        await send({"type": SEND_BATCH, "frames": [b"one", b"\x00" * 70_000, b"three"]})
        await send({"type": "websocket.send", "bytes": b"four"})  # the ordinary path still works
        await send({"type": SEND_BATCH, "frames": []})
        await send({"type": "websocket.close", "code": 1000})

    async with _serve(app, BatchingWebSocketsProtocol) as port:
        async with connect(f"ws://127.0.0.1:{port}/", max_size=None) as ws:
            got = [await asyncio.wait_for(ws.recv(), 5) for _ in range(4)]
    assert got == [b"one", b"\x00" * 70_000, b"three", b"four"]
    assert SEND_BATCH in seen[0]


async def test_plain_uvicorn_protocol_does_not_advertise_it() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["extensions"])
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    async with _serve(app, "websockets-sansio") as port:
        async with connect(f"ws://127.0.0.1:{port}/") as ws:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.recv(), 5)
    assert seen and SEND_BATCH not in seen[0]
