"""The ASGI entry point of a relay process, served from the moment its port opens.

``ServiceGate(service)`` answers the probes (``/_health``, ``/_ready``), ``/metrics`` and the
operator dashboard in every phase of ``relay.service.RelayService`` — while it starts, and while
an ingest process waits in standby for the writer lease (Kubernetes must see it alive, and not
ready). Every other request goes to the service's full app once it runs; before that an HTTP
request is answered 503 ``{"error": "NotReady"}`` and a WebSocket is closed with 1013 (try again
later). Both apps come from the one route table, ``relay.routes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from relay.routes import early_app

if TYPE_CHECKING:
    from relay.service_view import ServiceView


class ServiceGate:
    """ASGI app: ``service.app`` once the service runs, ``early_app(service)`` until then."""

    def __init__(self, service: ServiceView) -> None:
        self.service = service
        self.early = early_app(service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.service.app
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013, "reason": "relay not running yet"})
        else:
            await self.early(scope, receive, send)
