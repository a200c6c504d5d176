"""Connected ``subscribeRepos`` consumers: a registry for the admin API and the metrics.

``ConsumerTracking`` wraps the firehose package's ASGI WebSocket endpoint: it records each
connection (remote address, user agent, cursor, connect time) while it is open and counts the
bytes sent to it. It never touches the frames themselves.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firehose.uvicorn_batch import DIRECT_WRITE, SEND_BATCH
from relay.metrics import RelayMetrics

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

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "remote": self.remote, "userAgent": self.user_agent, "cursor": self.cursor,
                "connectedAt": self.connected_at, "framesSent": self.frames_sent, "bytesSent": self.bytes_sent}


class ConsumerRegistry:
    """Currently connected consumers."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self.metrics = metrics
        self._ids = itertools.count(1)
        self._open: dict[int, ConsumerInfo] = {}

    def open(self, remote: str, user_agent: str, cursor: str | None) -> ConsumerInfo:
        info = ConsumerInfo(next(self._ids), remote, user_agent, cursor, time.time())
        self._open[info.id] = info
        self.metrics.consumers.set(len(self._open))
        return info

    def close(self, info: ConsumerInfo) -> None:
        self._open.pop(info.id, None)
        self.metrics.consumers.set(len(self._open))

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
            self.metrics.bytes_out.inc(session.bytes_sent)
            self.close(info)

    def list(self) -> list[dict[str, Any]]:
        return [c.view() for c in self._open.values()]

    def __len__(self) -> int:
        return len(self._open)


class ConsumerTracking:
    """ASGI middleware around the subscribeRepos WebSocket endpoint."""

    def __init__(self, app: ASGIApp, registry: ConsumerRegistry) -> None:
        self.app = app
        self.registry = registry

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

        async def tracked_send(message: Message) -> None:
            nonlocal info
            if message["type"] == "websocket.accept" and info is None:
                info = self.registry.open(f"{client[0]}:{client[1]}", headers.get("user-agent", ""), cursor)
            elif message["type"] == "websocket.send" and info is not None:
                size = len(message.get("bytes") or b"") + len((message.get("text") or "").encode())
                info.frames_sent += 1
                info.bytes_sent += size
                metrics.bytes_out.inc(size)
            elif message["type"] == SEND_BATCH and info is not None:
                frames = message["frames"]
                size = sum(map(len, frames))
                info.frames_sent += len(frames)
                info.bytes_sent += size
                metrics.bytes_out.inc(size)
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
                    metrics.bytes_out.inc(batch.nbytes)
                return True

            scope = {**scope, "extensions": {**extensions, DIRECT_WRITE: {"write": tracked_write}}}

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            if info is not None:
                self.registry.close(info)
