"""Sibling relays: operator changes made here are passed on to peer relays, and relays say what they are.

A deployment may run several independent relays side by side (``RELAY_SIBLING_RELAYS``: their base
URLs, comma-separated). A ``requestCrawl`` and the admin changes that **succeeded here** — account
limits (``/admin/hosts/{h}/limits``), ``block`` / ``unblock``, domain bans (add and lift), account
takedowns and their reversal — are sent on to every sibling: the same method, path, query and body,
the same ``Authorization`` header, and ``Via: 1.1 atproto-relay``. A request that already carries
that ``Via`` came from a sibling: it is applied here and not sent on again (counted
``relay_sibling_received_total``), so a change travels one hop and two relays that list each
other never bounce it back and forth. Only our own pseudonym counts: a ``Via`` added by a load
balancer in front of the relay does not stop forwarding.

Forwarding never delays or fails the local action: :meth:`SiblingForwarder.offer` only queues.
Each sibling has its own queue (first in, first out, so a ban and its lifting arrive in order),
bounded in items (``max_items``) and in bytes (``max_bytes``, a request counted as its body, path
and header sizes plus ``FORWARD_OVERHEAD``); a change that does not fit is dropped, counted and
logged. One worker per sibling sends its queue's head: a 2xx is ``forwarded``; a transport error,
a 5xx, 408 or 429 is retried after a capped, jittered exponential backoff (a ``Retry-After`` is
honoured up to the cap), each retry counted ``retried``, until ``attempts`` tries have failed
(``failed``, logged); any other answer is the sibling's refusal (``rejected``, logged: e.g. it
does not know the host, or its admin token differs) and is not retried. Counters:
``relay_sibling_forwards_total{sibling, result}``; queued bytes: ``relay_sibling_queue_bytes{sibling}``.

Sibling URLs are operator configuration, not untrusted input: they are not SSRF-checked, and
redirects are not followed.

``ServerHeader`` is the ASGI middleware that names the relay on every HTTP response (``Server:
atproto-relay``; the WebSocket handshakes get it from ``relay.consumers.ConsumerTracking``); ``relay.hosts`` refuses to subscribe, as a PDS, a host whose
answer carries that name (``is_relay_server``) unless an operator adds it as a relay upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.jsonlog import fields
from relay.metrics import RelayMetrics

log = logging.getLogger("relay.siblings")

#: The product name in our ``Server`` header and the pseudonym in our ``Via`` header.
SERVER_NAME = "atproto-relay"
VIA = f"1.1 {SERVER_NAME}"
#: Bytes a queued change is counted as beyond its body, path and Authorization (object, headers).
FORWARD_OVERHEAD = 512
#: ``relay_sibling_forwards_total{result}`` values.
FORWARD_RESULTS = ("forwarded", "retried", "rejected", "failed", "dropped")
_RETRY_STATUSES = frozenset({408, 429})


def carries_our_via(headers: Mapping[str, str]) -> bool:
    """True when a ``Via`` entry (``protocol pseudonym [comment]``, comma-separated) names
    ``SERVER_NAME``: the request was forwarded by a sibling relay."""
    for entry in headers.get("via", "").split(","):
        parts = entry.split()
        if len(parts) >= 2 and parts[1].lower() == SERVER_NAME:
            return True
    return False


def is_relay_server(headers: Mapping[str, str]) -> bool:
    """True when a response's ``Server`` header names ``SERVER_NAME`` as its product
    (``atproto-relay`` or ``atproto-relay/<version>``)."""
    first = headers.get("server", "").split()
    return bool(first) and first[0].partition("/")[0].lower() == SERVER_NAME


_SERVER_HEADER = (b"server", SERVER_NAME.encode())


def with_server_header(message: Message) -> Message:
    """An ASGI ``http.response.start`` or ``websocket.accept`` message with ``Server:
    atproto-relay`` in place of any ``Server`` header it had."""
    kept = [h for h in message.get("headers") or () if h[0].lower() != b"server"]
    return {**message, "headers": [*kept, _SERVER_HEADER]}


class ServerHeader:
    """ASGI middleware: ``Server: atproto-relay`` on every HTTP response. WebSocket scopes pass
    untouched (a wrapper would cost a call per frame sent): the stream endpoints' own middleware
    (``relay.consumers.ConsumerTracking``) names the relay in their handshake answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message: Message) -> None:
            await send(with_server_header(message) if message["type"] == "http.response.start" else message)

        await self.app(scope, receive, named_send)


@dataclass(slots=True)
class Change:
    """One request to send to one sibling."""

    method: str
    path: str  # path and query, appended to the sibling's base URL
    body: bytes
    authorization: str | None
    content_type: str | None

    @property
    def size(self) -> int:
        return len(self.body) + len(self.path) + len(self.authorization or "") + FORWARD_OVERHEAD


class _Sibling:
    """One sibling's queue and byte count (owned by its worker and ``SiblingForwarder.offer``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queue: deque[Change] = deque()
        self.bytes = 0
        self.wake = asyncio.Event()


class SiblingForwarder:
    """Queues changes for the sibling relays and sends them (see the module docstring).
    ``siblings`` may be empty: then nothing is sent, and changes received from a sibling are
    still counted. ``client``: the HTTP client to use (closed by :meth:`close` only if made here)."""

    def __init__(self, siblings: Iterable[str], *, metrics: RelayMetrics, max_items: int = 1000,
                 max_bytes: int = 4 * 1024 * 1024, attempts: int = 8, retry_base: float = 1.0,
                 retry_max: float = 60.0, timeout: float = 10.0, client: httpx.AsyncClient | None = None) -> None:
        if max_items < 1 or max_bytes < 1 or attempts < 1 or retry_base <= 0 or retry_max < retry_base:
            raise ValueError("sibling queue bounds, attempts and retry delays must be positive")
        self.siblings = [_Sibling(url.rstrip("/")) for url in dict.fromkeys(siblings)]
        self.metrics = metrics
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.attempts = attempts
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout, follow_redirects=False,
                                                  headers={"user-agent": f"{SERVER_NAME} (sibling forward)"})
        self._tasks: list[asyncio.Task[None]] = []
        for sibling in self.siblings:
            self._set_queue_gauge(sibling)
            for result in FORWARD_RESULTS:  # every series from 0: an alert's increase() sees the first one
                self.metrics.child(self.metrics.sibling_forwards, sibling.url, result)

    def start(self) -> None:
        """Start one worker per sibling (idempotent)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(s), name=f"sibling {s.url}") for s in self.siblings]

    async def close(self) -> None:
        """Stop the workers; changes still queued are not sent (logged with their number)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        unsent = sum(len(s.queue) for s in self.siblings)
        if unsent:
            log.warning("sibling forwards not sent at stop", extra=fields(unsent=unsent))
        if self._own_client:
            await self.client.aclose()

    async def offer(self, request: Request) -> None:
        """Pass on ``request`` — a change that has just succeeded here — to every sibling, unless
        it came from one (it carries our ``Via``). Returns at once: nothing here waits for a sibling."""
        if carries_our_via(request.headers):
            self.metrics.sibling_received.inc()
            return
        if not self.siblings:
            return
        query = request.url.query
        change = Change(method=request.method, path=request.url.path + (f"?{query}" if query else ""),
                        body=await request.body(), authorization=request.headers.get("authorization"),
                        content_type=request.headers.get("content-type"))
        for sibling in self.siblings:
            self.enqueue(sibling, change)

    def enqueue(self, sibling: _Sibling, change: Change) -> bool:
        """Queue ``change`` for ``sibling``, or drop it (False) when the queue is full in items or bytes."""
        if len(sibling.queue) >= self.max_items or sibling.bytes + change.size > self.max_bytes:
            self._count(sibling, "dropped")
            log.warning("sibling queue full: change not forwarded",
                        extra=fields(sibling=sibling.url, method=change.method, path=change.path,
                                     queued=len(sibling.queue), queued_bytes=sibling.bytes))
            return False
        sibling.queue.append(change)
        sibling.bytes += change.size
        self._set_queue_gauge(sibling)
        sibling.wake.set()
        return True

    def queued(self, url: str) -> int:
        """Changes waiting for the sibling at ``url`` (its head included while it is being sent)."""
        return next((len(s.queue) for s in self.siblings if s.url == url.rstrip("/")), 0)

    async def _run(self, sibling: _Sibling) -> None:
        while True:
            while not sibling.queue:
                sibling.wake.clear()
                await sibling.wake.wait()
            change = sibling.queue[0]
            try:
                await self._deliver(sibling, change)
            finally:
                sibling.queue.popleft()
                sibling.bytes -= change.size
                self._set_queue_gauge(sibling)

    async def _deliver(self, sibling: _Sibling, change: Change) -> None:
        """Send ``change`` until the sibling answers something other than a transient failure, or
        ``attempts`` tries have failed."""
        headers = {"via": VIA}
        if change.authorization:
            headers["authorization"] = change.authorization
        if change.content_type:
            headers["content-type"] = change.content_type
        for attempt in range(1, self.attempts + 1):
            retry_after = 0.0
            try:
                resp = await self.client.request(change.method, sibling.url + change.path, content=change.body,
                                                 headers=headers)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"[:200]
            else:
                if resp.status_code < 300:
                    self._count(sibling, "forwarded")
                    return
                if resp.status_code < 500 and resp.status_code not in _RETRY_STATUSES:
                    self._count(sibling, "rejected")
                    log.warning("sibling refused a forwarded change",
                                extra=fields(sibling=sibling.url, method=change.method, path=change.path,
                                             status=resp.status_code, answer=resp.text[:200]))
                    return
                problem = f"HTTP {resp.status_code}"
                with contextlib.suppress(ValueError):
                    retry_after = float(resp.headers.get("retry-after", "0"))
            if attempt == self.attempts:
                self._count(sibling, "failed")
                log.error("sibling forward given up", extra=fields(sibling=sibling.url, method=change.method,
                                                                   path=change.path, attempts=attempt, error=problem))
                return
            self._count(sibling, "retried")
            delay = min(self.retry_max, self.retry_base * 2 ** (attempt - 1))
            delay = min(self.retry_max, max(random.uniform(delay / 2, delay), retry_after))
            log.info("sibling forward failed; retrying", extra=fields(sibling=sibling.url, path=change.path,
                                                                     attempt=attempt, error=problem,
                                                                     retry_in=round(delay, 2)))
            await asyncio.sleep(delay)

    def _count(self, sibling: _Sibling, result: str) -> None:
        self.metrics.child(self.metrics.sibling_forwards, sibling.url, result).inc()

    def _set_queue_gauge(self, sibling: _Sibling) -> None:
        self.metrics.child(self.metrics.sibling_queue_bytes, sibling.url).set(sibling.bytes)
