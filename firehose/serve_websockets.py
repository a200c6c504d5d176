"""Serving ``subscribeRepos`` from a plain ``websockets`` server (no ASGI layer).

``serve_subscribe_repos(broadcaster, host, port)`` starts a ``websockets.asyncio.server`` that
speaks only this endpoint. Pre-upgrade errors: ``websockets`` itself answers 405 for non-GET and
426 for a missing ``Upgrade`` header (plain-text bodies, which consumers must tolerate); this
module answers 404 for other paths, 400 for a bad cursor and 429 (JSON, ``Retry-After``) when the
broadcaster is at capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, InvalidState
from websockets.http11 import USER_AGENT, Request, Response
from websockets.protocol import Protocol, Side, State

from firehose.broadcast import Broadcaster, ConsumerSession, pump
from firehose.frames import MAX_FRAME_BYTES
from firehose.serve_asgi import SUBSCRIBE_REPOS_PATH, CursorError, error_json, parse_cursor
from firehose.serve_wire import WireBatch, binary_frame_header, write_live_batch


class _DirectWriter:
    def __init__(self, connection: ServerConnection, limit: int) -> None:
        self.connection = connection
        self.limit = limit

    def write(self, batch: WireBatch) -> bool:
        conn = self.connection
        protocol = conn.protocol
        if protocol.state is not State.OPEN:
            return True  # closing: the handler's pump sees the close
        # One transport call per consumer per batch, the batch framed once for every consumer.
        return write_live_batch(protocol, conn.transport, batch, self.limit)


def _write_binary_frames(protocol: Protocol, transport: asyncio.WriteTransport, frames: list[bytes]) -> None:
    """Write ``frames`` as binary messages with one ``writelines`` call. The caller has checked the
    connection is OPEN. Without extensions (this server disables compression) a server's binary
    frame is exactly header + payload, so the headers are built here (``Protocol.send_binary``
    costs ~8 µs a frame, most of a 50k events/s budget); with any extension negotiated it falls
    back to ``send_binary``. Anything the protocol already has queued is written first."""
    if protocol.extensions or protocol.side is not Side.SERVER or protocol.expect_continuation_frame:
        for frame in frames:
            protocol.send_binary(frame)
        transport.writelines(protocol.data_to_send())
        return
    if protocol.state is not State.OPEN:
        raise InvalidState(f"connection is {protocol.state.name.lower()}")
    parts = protocol.data_to_send()  # normally empty; keeps control frames in order
    header = binary_frame_header
    for frame in frames:
        parts.append(header(len(frame)))
        parts.append(frame)
    transport.writelines(parts)


def _sender_of(connection: ServerConnection) -> Callable[[list[bytes]], Awaitable[None]]:
    """``send_many`` for :func:`firehose.broadcast.pump`: frame every message with the sans-I/O
    protocol, hand all the bytes to the transport in one ``writelines`` (one syscall per list
    instead of one per frame), then wait for the write buffer to drain below its high-water
    mark. ``send_context`` is the connection's own wrapper around user writes: it checks the
    connection is open, raises ``ConnectionClosed`` otherwise, and awaits ``drain()`` on exit
    (its own flush then finds nothing left to write)."""

    async def send_many(frames: list[bytes]) -> None:
        while connection.send_in_progress is not None:  # never, unless someone fragments
            await asyncio.shield(connection.send_in_progress)
        async with connection.send_context():
            _write_binary_frames(connection.protocol, connection.transport, frames)

    return send_many


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
    ping_timeout: float | None = None,
    direct: bool = True,
    track: Callable[[ServerConnection, ConsumerSession], AbstractAsyncContextManager[Any]] | None = None,
    deflate: bool = False,
    server_header: str | None = None,
) -> Server:
    """Start the server (``async with`` it or call ``.close()``); ``port=0`` picks a free port.

    A live consumer's lag is probed with pings (``ConsumerTooSlow`` within ``broadcaster.max_lag``);
    the keepalive ping's timeout (default ``max_lag`` + 20 s) only catches peers that vanished
    while nothing was sent to them.

    With ``direct`` (default) a caught-up consumer is written to synchronously by the fan-out
    (frames written straight into its transport; the consumer is too slow when the connection's
    write buffer exceeds ``broadcaster.live_queue_bytes``). Replay always goes through ``pump``,
    one transport write per store read.
    ``track(connection, session)``, when given, is entered for the life of each consumer's
    connection (the relay keeps its registry of connected consumers with it).
    ``deflate``: offer permessage-deflate (off by default; a consumer that negotiates it gets
    compressed frames, each compressed once per consumer).
    ``server_header``: the ``Server`` header of every answer (None: the ``websockets`` default).
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
        async def probe() -> None:
            await (await connection.ping())

        async def send_final(frame: bytes) -> None:
            protocol = connection.protocol
            if protocol.state is State.OPEN:  # behind whatever is unsent; the close waits for nothing
                protocol.send_binary(frame)
                protocol.send_close(1008, "ConsumerTooSlow")
                connection.transport.writelines(protocol.data_to_send())

        async with track(connection, session) if track is not None else contextlib.nullcontext():
            try:
                await pump(session, connection.send, connection.wait_closed(), send_many=_sender_of(connection),
                           probe=probe, send_final=send_final)
            except ConnectionClosed:
                return
            await connection.close()  # after send_final: waits close_timeout for the peer, then aborts

    return await serve(
        handler,
        host,
        port,
        process_request=process_request,
        ping_interval=ping_interval,
        ping_timeout=broadcaster.max_lag + 20.0 if ping_timeout is None else ping_timeout,
        max_size=MAX_FRAME_BYTES,
        compression="deflate" if deflate else None,
        server_header=USER_AGENT if server_header is None else server_header,
    )
