"""The ASGI (Starlette) endpoint for ``com.atproto.sync.subscribeRepos``.

``subscribe_repos_app(broadcaster)`` is a raw ASGI app that handles both scopes on one path:

* HTTP: ``405`` for non-GET, ``426`` for a GET without ``Upgrade`` (JSON XRPC error bodies);
* WebSocket: ``400 InvalidRequest`` for a bad ``cursor``, ``429`` when the broadcaster is at
  capacity (via the ASGI denial-response extension, falling back to a 1013 close), otherwise
  accept and stream via :func:`firehose.broadcast.pump`. Under ``firehose.uvicorn_batch`` (what
  ``relay serve`` runs) a live consumer's lag is probed with pings, so a stalled one gets
  ``ConsumerTooSlow`` within ``Broadcaster.max_lag``; under plain uvicorn only its queue is bounded.
  There, too, a caught-up consumer is written to by the fan-out itself (``DIRECT_WRITE``: each
  live batch framed once for all consumers, one transport write per consumer per batch; too slow
  when its write buffer exceeds ``Broadcaster.live_queue_bytes``).

Mount it with ``subscribe_repos_routes(broadcaster)`` (a ``Route`` + ``WebSocketRoute`` pair).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from firehose.broadcast import Broadcaster, pump
from firehose.serve_wire import WireBatch
from firehose.uvicorn_batch import DIRECT_WRITE, PROBE, SEND_BATCH

SUBSCRIBE_REPOS_PATH = "/xrpc/com.atproto.sync.subscribeRepos"


class CursorError(ValueError):
    """The ``cursor`` query parameter is not an integer in [0, 2^53)."""


def parse_cursor(raw: str | None) -> int | None:
    """Parse the ``cursor`` query parameter (None when absent)."""
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 16:
        raise CursorError(raw)
    value = int(raw)
    if value >= 2**53:
        raise CursorError(raw)
    return value


def _error_body(error: str, message: str) -> dict[str, Any]:
    return {"error": error, "message": message}


async def upgrade_required(request: Request) -> JSONResponse:
    """The HTTP half of a subscription path: 405 for non-GET, 426 for a GET without ``Upgrade``."""
    if request.method != "GET":
        return JSONResponse(
            _error_body("MethodNotAllowed", "subscription endpoints accept GET only"),
            status_code=405,
            headers={"Allow": "GET"},
        )
    return JSONResponse(
        _error_body("UpgradeRequired", "this is a WebSocket endpoint"),
        status_code=426,
        headers={"Upgrade": "websocket", "Connection": "Upgrade"},
    )


async def deny_websocket(ws: WebSocket, status: int, error: str, message: str) -> None:
    """Refuse a WebSocket before the upgrade: HTTP ``status`` with an XRPC error body (ASGI
    denial-response extension), or a close (1013 for 429, else 1008) where it is missing."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse(_error_body(error, message), status_code=status))
    else:
        await ws.close(code=1013 if status == 429 else 1008, reason=error)


class _ExtensionWriter:
    """The ``DIRECT_WRITE`` extension as a :class:`firehose.broadcast.DirectWriter`."""

    __slots__ = ("_limit", "_write")

    def __init__(self, write: Callable[[WireBatch, int], bool], limit: int) -> None:
        self._write = write
        self._limit = limit

    def write(self, batch: WireBatch) -> bool:
        return self._write(batch, self._limit)


class SubscribeReposWebSocket:
    """The WebSocket half; an ASGI app usable as a ``WebSocketRoute`` endpoint."""

    def __init__(self, broadcaster: Broadcaster) -> None:
        self.broadcaster = broadcaster

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ws = WebSocket(scope, receive, send)
        try:
            cursor = parse_cursor(ws.query_params.get("cursor"))
        except CursorError:
            await deny_websocket(ws, 400, "InvalidRequest", "cursor must be a non-negative integer")
            return
        if self.broadcaster.at_capacity:
            await deny_websocket(ws, 429, "RateLimitExceeded", "too many consumers")
            return
        await ws.accept()
        session = self.broadcaster.session(cursor)

        async def send_frame(frame: bytes) -> None:
            # the raw ASGI send: Starlette's state bookkeeping per frame is measurable at 50k/s
            await send({"type": "websocket.send", "bytes": frame})

        send_many = send_final = probe = None
        extensions = scope.get("extensions") or {}
        if SEND_BATCH in extensions:  # firehose.uvicorn_batch: one write per batch

            async def send_many(frames: list[bytes]) -> None:
                await send({"type": SEND_BATCH, "frames": frames})

            async def send_final(frame: bytes) -> None:
                await send({"type": SEND_BATCH, "frames": [frame], "close": (1008, "ConsumerTooSlow")})

            direct = extensions.get(DIRECT_WRITE)
            if direct is not None:  # live batches written by the fan-out itself
                session.direct_writer = _ExtensionWriter(direct["write"], self.broadcaster.live_queue_bytes)

        if PROBE in extensions:  # firehose.uvicorn_batch: lag probes (ConsumerTooSlow at any rate)

            async def probe() -> None:
                await send({"type": PROBE})

        async def until_disconnect() -> None:
            # Client frames are ignored (server-to-client protocol); we only watch for the close.
            while (await ws.receive())["type"] != "websocket.disconnect":
                pass

        try:
            await pump(session, send_frame, until_disconnect(), send_many=send_many, probe=probe,
                       send_final=send_final)
        except (WebSocketDisconnect, OSError, RuntimeError):
            return
        if session.too_slow.is_set() and send_final is not None:
            return  # the error frame and the close went out together; the protocol finishes the close
        if ws.client_state.name == "DISCONNECTED" or ws.application_state.name == "DISCONNECTED":
            return
        try:
            await ws.close(code=1000)
        except (RuntimeError, OSError):
            pass


def subscribe_repos_endpoint(broadcaster: Broadcaster) -> SubscribeReposWebSocket:
    """The WebSocket handler to mount with ``WebSocketRoute(SUBSCRIBE_REPOS_PATH, ...)``."""
    return SubscribeReposWebSocket(broadcaster)


def subscribe_repos_routes(broadcaster: Broadcaster, path: str = SUBSCRIBE_REPOS_PATH) -> list[BaseRoute]:
    """Both routes for the path: WebSocket streaming plus the pre-upgrade HTTP errors."""
    return [
        WebSocketRoute(path, subscribe_repos_endpoint(broadcaster)),
        Route(path, upgrade_required, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
    ]


def error_json(error: str, message: str) -> bytes:
    """JSON body in the XRPC error schema (shared with the websockets adapter)."""
    return json.dumps(_error_body(error, message)).encode()
