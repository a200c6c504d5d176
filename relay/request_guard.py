"""Bounds on what an HTTP request may bring, applied before any handler runs.

``RequestGuard`` is raw ASGI middleware around the whole app (HTTP scopes only; WebSocket
upgrades pass through):

* a request whose path or query string carries a NUL character is answered ``400
  InvalidRequest`` (PostgreSQL text cannot hold NUL: such a value must never reach a query);
* a body announced (``Content-Length``) larger than ``max_body`` bytes is answered ``413
  PayloadTooLarge`` at once, without reading it; a body sent without a length (chunked) is
  counted as it is read and the read fails with the same 413 once it passes ``max_body``. So no
  handler ever holds more than ``max_body`` bytes of a body, and a body nobody reads is never
  buffered (uvicorn stops reading the socket until the app asks for more);
* a ``requestCrawl`` from a client address that has used up its calls
  (``RELAY_CRAWL_REQUESTS_PER_MINUTE``, ``HostManager.crawl_client_wait``) is answered ``429
  RateLimitExceeded`` with ``Retry-After``, before its body is read.

Every answer is an XRPC error body ``{"error", "message"}``. What the client still sends of a
refused body is read and discarded by uvicorn (never held), until its keep-alive timeout.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.client_limits import RateLimited, client_address
from relay.xrpc import XrpcError

#: Request bodies (XRPC procedures and the admin API take small JSON objects): at most 64 KiB.
MAX_BODY_BYTES = 64 * 1024
CRAWL_PATH = "/xrpc/com.atproto.sync.requestCrawl"


class BodyTooLarge(XrpcError):
    """The request body is over the limit (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, "PayloadTooLarge", f"request body over {limit} bytes")


def _content_length(scope: Scope) -> int | None:
    """The announced body length; -1 when the header is malformed; None when absent."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value) if value.strip().isdigit() else -1
            except ValueError:
                return -1
    return None


class RequestGuard:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b"") \
                or b"\x00" in scope.get("query_string", b""):
            await _answer(send, XrpcError(400, "InvalidRequest", "NUL characters are not allowed in a request"))
            return
        if scope.get("path") == CRAWL_PATH and (hosts := _host_manager(scope)) is not None:
            wait = hosts.crawl_client_wait(client_address(scope))
            if wait:
                await _answer(send, RateLimited(wait, "too many requestCrawl calls from this address"))
                return
        length = _content_length(scope)
        if length is not None and length < 0:
            await _answer(send, XrpcError(400, "InvalidRequest", "malformed Content-Length"))
            return
        if length is not None and length > self.max_body:
            await _answer(send, BodyTooLarge(self.max_body))
            return
        limit = self.max_body
        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, capped_receive, send)


def _host_manager(scope: Scope) -> Any:
    """The ``relay.hosts.HostManager`` of the app serving ``scope`` (Starlette puts itself in
    ``scope["app"]``; the relay's app keeps its service in ``state``), or None (no requestCrawl)."""
    app = scope.get("app")
    service = getattr(getattr(app, "state", None), "service", None)
    return getattr(service, "hosts", None)


async def _answer(send: Send, error: XrpcError) -> None:
    """Send ``error`` as the whole response (the body, if any, is left unread)."""
    await error.response()({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - a JSONResponse never reads
    return {"type": "http.disconnect"}
