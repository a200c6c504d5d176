"""Tiny HTTP layer on top of a ``websockets`` server (one port serves XRPC GETs and the stream).

``websockets`` parses every request; ``process_request`` answers the plain GETs and lets the
WebSocket upgrade for ``subscribeRepos`` through. This keeps each simulated host at a single lean
asyncio server, which matters when one process has to push many thousands of frames a second.
"""

from __future__ import annotations

import http
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

Handler = Callable[[str, dict[str, str]], Awaitable[Response | None] | Response | None]


def response(status: int, body: bytes, content_type: str) -> Response:
    """An HTTP response that closes the connection after it is sent."""
    headers = Headers(
        [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close")]
    )
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def json_response(obj: Any, status: int = 200) -> Response:
    return response(status, json.dumps(obj).encode(), "application/json")


def xrpc_error(status: int, error: str, message: str = "") -> Response:
    """An XRPC error body ``{"error", "message"}``."""
    return json_response({"error": error, "message": message or error}, status)


def split_request(request: Request) -> tuple[str, dict[str, str]]:
    """Path and single-valued query parameters of a request."""
    parts = urlsplit(request.path)
    return parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()}


def is_upgrade(request: Request) -> bool:
    return "websocket" in request.headers.get("Upgrade", "").lower()
