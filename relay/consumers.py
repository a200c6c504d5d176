"""Connected ``subscribeRepos`` consumers: a registry for the admin API and the metrics.

``ConsumerTracking`` wraps the firehose package's ASGI WebSocket endpoint: it records each
connection (remote address, user agent, cursor, connect time) while it is open and counts the
bytes sent to it. It never touches the frames themselves.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firehose.uvicorn_batch import DIRECT_WRITE, SEND_BATCH
from relay.metrics import RelayMetrics
from relay.siblings import with_server_header

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

    from firehose.broadcast import ConsumerSession
    from firehose.serve_wire import WireBatch


@dataclass(slots=True)
class ConsumerInfo:
    id: int
    remote: str
    user_agent: str
    cursor: str | None
    connected_at: float
    frames_sent: int = 0
    bytes_sent: int = 0
    #: what the consumer is sent: ``cbor`` (subscribeRepos), ``json`` or ``json+zstd`` (/subscribe)
    encoding: str = "cbor"

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "remote": self.remote, "userAgent": self.user_agent, "cursor": self.cursor,
                "connectedAt": self.connected_at, "framesSent": self.frames_sent, "bytesSent": self.bytes_sent,
                "encoding": self.encoding}


class ConsumerRegistry:
    """Currently connected consumers, and the bytes and frames sent per encoding since start
    (closed consumers included): the bytes written to each consumer's connection, as encoded for it."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._open: dict[int, ConsumerInfo] = {}
        #: encoding -> [bytes, frames] of consumers already closed
        self._closed: dict[str, list[int]] = {}

    def open(self, remote: str, user_agent: str, cursor: str | None, encoding: str = "cbor") -> ConsumerInfo:
        info = ConsumerInfo(next(self._ids), remote, user_agent, cursor, time.time(), encoding=encoding)
        self._open[info.id] = info
        self.metrics.consumers.set(len(self._open))
        return info

    def close(self, info: ConsumerInfo) -> None:
        if self._open.pop(info.id, None) is not None:
            done = self._closed.setdefault(info.encoding, [0, 0])
            done[0] += info.bytes_sent
            done[1] += info.frames_sent
        self.metrics.consumers.set(len(self._open))

    def by_encoding(self) -> dict[str, dict[str, int]]:
        """Per encoding: ``connected`` consumers now, ``bytesSent`` and ``framesSent`` since start."""
        out = {enc: {"connected": 0, "bytesSent": b, "framesSent": f} for enc, (b, f) in self._closed.items()}
        for info in self._open.values():
            row = out.setdefault(info.encoding, {"connected": 0, "bytesSent": 0, "framesSent": 0})
            row["connected"] += 1
            row["bytesSent"] += info.bytes_sent
            row["framesSent"] += info.frames_sent
        return out

    @contextlib.asynccontextmanager
    async def tracking(self, connection: ServerConnection, session: ConsumerSession) -> AsyncIterator[None]:
        """Registry entry for a consumer of the plain-websockets listener (``RELAY_FIREHOSE_BIND``).

        Frames there go straight into the connection's transport, so the count comes from the
        session when the connection ends; bytes are the frames' sizes as the session reports them.
        """
        request = connection.request
        headers = request.headers if request is not None else {}
        query = parse_qs(urlsplit(request.path).query) if request is not None else {}
        remote = connection.remote_address or ("?", 0)
        cursors = query.get("cursor")
        info = self.open(f"{remote[0]}:{remote[1]}", headers.get("User-Agent", ""),
                         cursors[-1] if cursors else None)
        try:
            yield
        finally:
            info.frames_sent = session.sent
            info.bytes_sent = session.bytes_sent
            self.metrics.child(self.metrics.bytes_out, "cbor").inc(session.bytes_sent)
            self.close(info)

    def list(self) -> list[dict[str, Any]]:
        return [c.view() for c in self._open.values()]

    def __len__(self) -> int:
        return len(self._open)


def jetstream_encoding(scope: Scope) -> str:
    """A /subscribe connection's encoding: ``json+zstd`` when it asked for compression (query
    ``compress=true`` or a ``zstdDictionary``, or a ``Socket-Encoding: zstd`` header), else ``json``."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    headers = dict(scope.get("headers", []))
    zstd = (query.get("compress", [""])[-1] == "true" or bool(query.get("zstdDictionary"))
            or b"zstd" in headers.get(b"socket-encoding", b""))
    return "json+zstd" if zstd else "json"


class ConsumerTracking:
    """ASGI middleware around a consumer WebSocket endpoint: registers the consumer and counts
    what is written to it as sent, in ``relay_consumer_sent_bytes_total{encoding}`` (``cbor`` for
    subscribeRepos, ``json`` for the JSON stream, compressed or not); ``encoding(scope)`` names what
    the connection is sent (default ``cbor``; the consumer list tells ``json`` from ``json+zstd``).
    It also names the relay in the handshake's answer (``Server: atproto-relay``,
    ``relay.siblings.with_server_header``): these are the app's only WebSocket endpoints, and the
    send this middleware wraps anyway is the one place where that costs nothing per frame."""

    def __init__(self, app: ASGIApp, registry: ConsumerRegistry,
                 encoding: Callable[[Scope], str] | None = None) -> None:
        self.app = app
        self.registry = registry
        self.encoding = encoding or (lambda scope: "cbor")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        query = scope.get("query_string", b"").decode("latin-1")
        cursor = next((p.split("=", 1)[1] for p in query.split("&") if p.startswith("cursor=")), None)
        info: ConsumerInfo | None = None
        metrics = self.registry.metrics
        encoding = self.encoding(scope)
        sent_bytes = metrics.child(metrics.bytes_out, "json" if encoding.startswith("json") else encoding)

        async def tracked_send(message: Message) -> None:
            nonlocal info
            if message["type"] == "websocket.accept" and info is None:
                info = self.registry.open(f"{client[0]}:{client[1]}", headers.get("user-agent", ""), cursor,
                                          encoding)
                message = with_server_header(message)
            elif message["type"] == "websocket.send" and info is not None:
                size = len(message.get("bytes") or b"") + len((message.get("text") or "").encode())
                info.frames_sent += 1
                info.bytes_sent += size
                sent_bytes.inc(size)
            elif message["type"] == SEND_BATCH and info is not None:
                frames = message["frames"]
                size = sum(map(len, frames))
                info.frames_sent += len(frames)
                info.bytes_sent += size
                sent_bytes.inc(size)
            await send(message)

        extensions = scope.get("extensions") or {}
        direct = extensions.get(DIRECT_WRITE)
        if direct is not None:  # live batches written by the fan-out, past ``send``: counted here
            write = direct["write"]

            def tracked_write(batch: WireBatch, limit: int) -> bool:
                if not write(batch, limit):
                    return False
                if info is not None:
                    info.frames_sent += len(batch.frames)
                    info.bytes_sent += batch.nbytes
                    sent_bytes.inc(batch.nbytes)
                return True

            scope = {**scope, "extensions": {**extensions, DIRECT_WRITE: {"write": tracked_write}}}

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            if info is not None:
                self.registry.close(info)
