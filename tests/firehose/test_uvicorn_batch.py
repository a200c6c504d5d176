"""firehose.uvicorn_batch: the batched-send ASGI extension over a real uvicorn server and socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from websockets.asyncio.client import connect

from firehose.serve_wire import WireBatch
from firehose.uvicorn_batch import DIRECT_WRITE, SEND_BATCH, BatchingWebSocketsProtocol

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def _serve(app: Any, ws: Any, *, deflate: bool = False) -> AsyncIterator[int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws=ws,
                                          ws_per_message_deflate=deflate))
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


@pytest.mark.parametrize("deflate", [False, True])
async def test_direct_write_goes_out_in_order_with_the_other_sends(deflate: bool) -> None:
    """The synchronous write shares the connection with the ASGI sends, in call order; with
    permessage-deflate negotiated each frame is compressed for this connection."""
    results: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][DIRECT_WRITE]["write"]
        await receive()
        await send({"type": "websocket.accept"})
        await receive()  # "go": the client counts what arrives from now on
        await send({"type": SEND_BATCH, "frames": [b"one"]})
        results.append(write(WireBatch([b"two", b"\x01" * 70_000]), 1 << 20))
        await send({"type": "websocket.send", "bytes": b"three"})
        results.append(write(WireBatch([b"four" * 40]), 1 << 20))
        await receive()  # the client's close

    async with _serve(app, BatchingWebSocketsProtocol, deflate=deflate) as port:
        async with connect(f"ws://127.0.0.1:{port}/", max_size=None,
                           compression="deflate" if deflate else None) as ws:
            wire = 0
            receive_data = ws.protocol.receive_data

            def counted(data: bytes) -> None:
                nonlocal wire
                wire += len(data)
                receive_data(data)

            ws.protocol.receive_data = counted  # type: ignore[method-assign,assignment]
            await ws.send(b"go")
            got = [await asyncio.wait_for(ws.recv(), 5) for _ in range(5)]
            assert (ws.protocol.extensions != []) is deflate
    assert got == [b"one", b"two", b"\x01" * 70_000, b"three", b"four" * 40]
    assert results == [True, True]
    assert (wire < 10_000) is deflate  # compressed when negotiated, not when not


async def test_direct_write_refuses_a_full_buffer_and_writes_nothing() -> None:
    """Over ``limit`` unsent bytes the write returns False and leaves the stream as it was: the
    peer, once it reads, gets exactly the batches that were accepted."""
    accepted: list[int] = []
    refused = asyncio.Event()
    frame = b"\x02" * 32_768

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][DIRECT_WRITE]["write"]
        await receive()
        await send({"type": "websocket.accept"})
        i = 0
        while not refused.is_set():
            ok = write(WireBatch([i.to_bytes(4, "big") + frame]), 256 * 1024)
            if ok:
                accepted.append(i)
                i += 1
            else:
                refused.set()
            await asyncio.sleep(0)  # let the loop try to flush
        await send({"type": "websocket.send", "bytes": b"end"})
        await receive()

    async with _serve(app, BatchingWebSocketsProtocol) as port:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        async with connect(f"ws://127.0.0.1:{port}/", sock=sock, max_size=None, max_queue=1) as ws:
            await asyncio.wait_for(refused.wait(), 10)  # the client has not read anything yet
            got = []
            while (msg := await asyncio.wait_for(ws.recv(), 5)) != b"end":
                assert isinstance(msg, bytes)
                got.append(int.from_bytes(msg[:4], "big"))
    assert accepted and got == accepted

