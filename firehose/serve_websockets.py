"""Serving ``subscribeRepos`` from a plain ``websockets`` server (no ASGI layer).

``serve_subscribe_repos(broadcaster, host, port)`` starts a ``websockets.asyncio.server`` that
speaks only this endpoint. Pre-upgrade errors: ``websockets`` itself answers 405 for non-GET and
426 for a missing ``Upgrade`` header (plain-text bodies, which consumers must tolerate); this
module answers 404 for other paths, 400 for a bad cursor and 429 (JSON, ``Retry-After``) when the
broadcaster is at capacity.
"""

from __future__ import annotations

import contextlib
import http
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import State

from firehose.broadcast import Broadcaster, ConsumerSession, pump
from firehose.frames import MAX_FRAME_BYTES
from firehose.serve_asgi import SUBSCRIBE_REPOS_PATH, CursorError, error_json, parse_cursor


class _DirectWriter:
    def __init__(self, connection: ServerConnection, limit: int) -> None:
        self.connection = connection
        self.limit = limit

    def write(self, frames: list[bytes]) -> bool:
        conn = self.connection
        protocol = conn.protocol
        if protocol.state is not State.OPEN:
            return True  # closing: the handler's pump sees the close
        transport = conn.transport
        if transport.get_write_buffer_size() > self.limit:
            return False
        # Sans-I/O protocol API: frame every message, then hand the bytes to the transport in
        # one call (one syscall per consumer per batch instead of one per frame).
        for frame in frames:
            protocol.send_binary(frame)
        transport.writelines(protocol.data_to_send())
        return True


def _json_response(status: http.HTTPStatus, error: str, message: str, **headers: str) -> Response:
    body = error_json(error, message)
    h = Headers({"Content-Type": "application/json", "Content-Length": str(len(body)), **headers})
    return Response(status.value, status.phrase, h, body)


def _cursor_of(path: str) -> int | None:
    values = parse_qs(urlsplit(path).query).get("cursor")
    return parse_cursor(values[-1] if values else None)


async def serve_subscribe_repos(
    broadcaster: Broadcaster,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    path: str = SUBSCRIBE_REPOS_PATH,
    ping_interval: float | None = 20.0,
    ping_timeout: float | None = 20.0,
    direct: bool = True,
    track: Callable[[ServerConnection, ConsumerSession], AbstractAsyncContextManager[Any]] | None = None,
) -> Server:
    """Start the server (``async with`` it or call ``.close()``); ``port=0`` picks a free port.

    With ``direct`` (default) a caught-up consumer is written to synchronously by the fan-out
    (frames written straight into its transport; the consumer is too slow when the connection's
    write buffer exceeds ``broadcaster.live_queue_bytes``). Replay always goes through ``pump``.
    ``track(connection, session)``, when given, is entered for the life of each consumer's
    connection (the relay keeps its registry of connected consumers with it).
    """

    def process_request(connection: ServerConnection, request: Request) -> Response | None:
        if getattr(request, "method", "GET") != "GET" or "websocket" not in request.headers.get("Upgrade", "").lower():
            return None  # websockets answers 405 / 426 itself
        if urlsplit(request.path).path != path:
            return _json_response(http.HTTPStatus.NOT_FOUND, "NotFound", "unknown endpoint")
        try:
            _cursor_of(request.path)
        except CursorError:
            return _json_response(
                http.HTTPStatus.BAD_REQUEST, "InvalidRequest", "cursor must be a non-negative integer"
            )
        if broadcaster.at_capacity:
            return _json_response(
                http.HTTPStatus.TOO_MANY_REQUESTS, "RateLimitExceeded", "too many consumers", **{"Retry-After": "5"}
            )
        return None

    async def handler(connection: ServerConnection) -> None:
        assert connection.request is not None
        session = broadcaster.session(_cursor_of(connection.request.path))
        if direct:
            session.direct_writer = _DirectWriter(connection, broadcaster.live_queue_bytes)
        async with track(connection, session) if track is not None else contextlib.nullcontext():
            try:
                await pump(session, connection.send, connection.wait_closed())
            except ConnectionClosed:
                return
            await connection.close()

    return await serve(
        handler,
        host,
        port,
        process_request=process_request,
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
        max_size=MAX_FRAME_BYTES,
        compression=None,
    )
