"""Connection limits of the main port, enforced in uvicorn's protocol objects (below the app).

``ConnectionLimits(header_timeout=, max_connections=, max_websockets=)`` is shared by one server's
connections; ``limits.protocols()`` gives the HTTP and WebSocket protocol classes to hand to
``uvicorn.Config(http=…, ws=…)``:

* **Header (handshake) timeout.** A connection must have sent a request's complete headers within
  ``header_timeout`` seconds of opening, and again within ``header_timeout`` of each response (a
  keep-alive connection's next request). A WebSocket upgrade is such a request, so the same
  deadline covers the handshake. Past it the connection is answered ``408`` and closed: a
  slowloris client (a header byte every few seconds) or an idle connection never holds a socket
  longer than that. A request whose headers are in is not affected (its body and response take
  as long as the app lets them); an upgraded WebSocket is the stream's business (pings).
* **Connection cap.** Past ``max_connections`` open connections (HTTP and WebSocket) a new one is
  answered ``503`` with ``Retry-After`` and closed at once, before it is read.
* **WebSocket cap.** Past ``max_websockets`` open WebSockets an upgrade request is answered
  ``503`` with ``Retry-After`` instead of being upgraded.

0 turns a limit off. Every refusal is counted in ``refused`` by reason (``header_timeout``,
``too_many_connections``, ``too_many_websockets``), exported as ``relay_http_refused_total{reason}``
(see :func:`export`), and logged (the first ten of each reason, then one in a thousand).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import h11
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.h11_impl import H11Protocol

from firehose.uvicorn_batch import BatchingWebSocketsProtocol

log = logging.getLogger("relay.connections")

#: seconds a refused client is told to wait before trying again
RETRY_AFTER = 5
REASONS = ("header_timeout", "too_many_connections", "too_many_websockets")


def _raw_response(status: str, error: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": error, "message": message}).encode()
    head = [f"HTTP/1.1 {status}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionLimits:
    """See the module docstring."""

    def __init__(self, *, header_timeout: float, max_connections: int, max_websockets: int) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.max_websockets = max_websockets
        self.refused: Counter[str] = Counter()
        self.websockets = 0  # open WebSockets
        #: the server's set of open connections (uvicorn's ``ServerState.connections``)
        self.connections: set[Any] = set()

    def refuse(self, reason: str, client: object) -> None:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n <= 10 or n % 1000 == 0:
            log.info("connection refused", extra={"reason": reason, "client": str(client), "refused": n})

    def protocols(self) -> tuple[type[H11Protocol], type[BatchingWebSocketsProtocol]]:
        """The HTTP and WebSocket protocol classes bound to these limits."""
        http = type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": self})
        ws = type("CountedWebSocketsProtocol", (CountedWebSocketsProtocol,), {"limits": self})
        return http, ws


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header timeout and both caps (see the module docstring)."""

    limits: ClassVar[ConnectionLimits]
    _header_timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        limits.connections = self.connections
        if limits.max_connections and len(self.connections) > limits.max_connections:
            self._refuse("too_many_connections", _raw_response(
                "503 Service Unavailable", "TooManyConnections", "the relay is at its connection limit",
                RETRY_AFTER))
            return
        self._arm()

    def _refuse(self, reason: str, answer: bytes) -> None:
        self._refused = True
        self._disarm()
        self.limits.refuse(reason, self.client)
        self.transport.write(answer)
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        if self.limits.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        """The deadline passed: close the connection unless a request's headers are all in."""
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._refuse("header_timeout", _raw_response("408 Request Timeout", "RequestTimeout",
                                                     "request headers not received in time"))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._disarm()  # a request's headers are in

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()
        limits = self.limits
        if limits.max_websockets and limits.websockets >= limits.max_websockets:
            self._refuse("too_many_websockets", _raw_response(
                "503 Service Unavailable", "TooManyWebSockets", "the relay is at its WebSocket limit",
                RETRY_AFTER))
            return
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers are due within the timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class CountedWebSocketsProtocol(BatchingWebSocketsProtocol):
    """The relay's WebSocket protocol, counting open WebSockets for the cap."""

    limits: ClassVar[ConnectionLimits]
    _counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.limits.websockets += 1
        self._counted = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self.limits.websockets -= 1
        super().connection_lost(exc)


def export(limits: ConnectionLimits, registry: CollectorRegistry) -> None:
    """Publish ``relay_http_refused_total{reason}``, ``relay_http_connections`` and
    ``relay_websockets`` (read at scrape time) in ``registry``."""
    registry.register(_Collector(limits))


class _Collector:
    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily("relay_http_refused", "Main-port connections refused or closed by a limit",
                                      labels=["reason"])
        for reason in REASONS:
            refused.add_metric([reason], self.limits.refused[reason])
        yield refused
        yield GaugeMetricFamily("relay_http_connections", "Open connections on the main port (HTTP and WebSocket)",
                                value=len(self.limits.connections))
        yield GaugeMetricFamily("relay_websockets", "Open WebSockets on the main port", value=self.limits.websockets)
