"""relay.keepalive against real sockets: the simulator's PLC and a raw server that answers with
every body framing, closes idle connections, stalls or sends too much."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from relay.keepalive import HttpError, KeepAliveClient
from sim.plc import SimPLC

Reply = Callable[[str], bytes | None]  # request target -> raw response (None: stall)


class RawServer:
    """Answers each request on a connection with ``reply(target)``; counts connections."""

    def __init__(self, reply: Reply, close_after: int = 0) -> None:
        self.reply = reply
        self.close_after = close_after  # close the connection after this many responses (0 = never)
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode()
                raw = self.reply(target)
                if raw is None:
                    await asyncio.sleep(3600)
                    return
                writer.write(raw)
                await writer.drain()
                served += 1
                if self.close_after and served >= self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_keep_alive_against_the_simulated_directory(plc: SimPLC) -> None:
    plc.docs["did:plc:x"] = {"id": "did:plc:x"}
    client = KeepAliveClient(plc.url, max_connections=2)
    try:
        results = await asyncio.gather(*(client.get("/did:plc:x", max_bytes=1000) for _ in range(20)))
        assert all(r == (200, b'{"id": "did:plc:x"}') for r in results)
        assert (await client.get("/did:plc:y", max_bytes=1000))[0] == 404
        assert plc.connections == 2 and plc.requests == 21  # two connections, reused
    finally:
        await client.aclose()


def _framed(kind: str) -> Reply:
    body = b'{"ok": true}'

    def reply(target: str) -> bytes:
        if kind == "length":
            return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        if kind == "chunked":
            return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"4;ext=1\r\n" + body[:4] + b"\r\n" + b"%x\r\n" % (len(body) - 4) + body[4:] + b"\r\n0\r\nX-T: 1\r\n\r\n")
        if kind == "interim":
            return b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body), body)
        return b"HTTP/1.0 200 OK\r\n\r\n" + body  # close-delimited

    return reply


@pytest.mark.parametrize(("kind", "reused"), [("length", True), ("chunked", True), ("interim", True),
                                              ("close", False)])
async def test_body_framings(kind: str, reused: bool) -> None:
    server = RawServer(_framed(kind), close_after=1 if kind == "close" else 0)
    client = KeepAliveClient(await server.start())
    try:
        for _ in range(3):
            assert await client.get("/a", max_bytes=100) == (200, b'{"ok": true}')
        assert server.connections == (1 if reused else 3)
    finally:
        await client.aclose()
        await server.stop()


async def test_connection_closed_while_idle_is_retried_once_on_a_new_one() -> None:
    server = RawServer(_framed("length"), close_after=1)  # keep-alive advertised, then closed
    client = KeepAliveClient(await server.start())
    try:
        assert (await client.get("/a", max_bytes=100))[0] == 200
        await asyncio.sleep(0)  # nothing to wait for: the retry covers the close however late it lands
        assert (await client.get("/b", max_bytes=100))[0] == 200
        assert server.connections == 2
    finally:
        await client.aclose()
        await server.stop()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n" + b"x" * 500,  # over max_bytes
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1f4\r\n" + b"x" * 500 + b"\r\n0\r\n\r\n",
    b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 500,
    b"SMTP ready\r\n\r\n",  # not HTTP
    b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nshort",  # truncated by the close below
])
async def test_bad_or_oversized_responses_raise(reply: bytes) -> None:
    server = RawServer(lambda target: reply, close_after=1)
    client = KeepAliveClient(await server.start())
    try:
        with pytest.raises(HttpError):
            await client.get("/a", max_bytes=100)
    finally:
        await client.aclose()
        await server.stop()


async def test_a_stalled_server_times_out_and_unreachable_fails() -> None:
    server = RawServer(lambda target: None)
    client = KeepAliveClient(await server.start(), timeout=0.2)
    try:
        with pytest.raises(HttpError, match="no answer"):
            await client.get("/a", max_bytes=100)
    finally:
        await client.aclose()
        await server.stop()
    dead = KeepAliveClient("http://127.0.0.1:9")
    with pytest.raises(HttpError):
        await dead.get("/a", max_bytes=100)
    with pytest.raises(ValueError):
        KeepAliveClient("ftp://example.com")
