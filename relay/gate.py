"""The ASGI entry point of a relay process, served from the moment its port opens.

``ServiceGate(service)`` answers the probes (``/_health``, ``/_ready``), ``/metrics`` and the
operator dashboard in every phase of ``relay.service.RelayService`` — while it starts, and while
an ingest process waits in standby for the writer lease (Kubernetes must see it alive, and not
ready). Every other request goes to the service's full app once it runs; before that an HTTP
request is answered 503 ``{"error": "NotReady"}`` and a WebSocket is closed with 1013 (try again
later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from relay.app import health, metrics, ready
from relay.dashboard import dashboard_routes
from relay.siblings import ServerHeader
from relay.xrpc import XrpcError

if TYPE_CHECKING:
    from relay.service import RelayService


async def _not_ready(request: Request) -> Response:
    service: RelayService = request.app.state.service
    reasons = await service.readiness()
    return JSONResponse({"error": "NotReady", "message": f"the relay is not running yet ({service.phase})",
                         "reasons": reasons}, status_code=503, headers={"retry-after": "5"})


async def _xrpc_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, XrpcError)
    return exc.response()


def early_app(service: RelayService) -> Starlette:
    """Probes, metrics and dashboard; 503 for anything else."""
    routes: list[BaseRoute] = [Route("/_health", health), Route("/_ready", ready), Route("/metrics", metrics)]
    routes += dashboard_routes()
    routes.append(Route("/{rest:path}", _not_ready, methods=["GET", "HEAD", "POST", "PUT", "DELETE"]))
    app = Starlette(routes=routes, middleware=[Middleware(ServerHeader)],
                    exception_handlers={XrpcError: _xrpc_error})
    app.state.service = service
    return app


class ServiceGate:
    """ASGI app: ``service.app`` once the service runs, ``early_app(service)`` until then."""

    def __init__(self, service: RelayService) -> None:
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
