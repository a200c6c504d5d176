"""Every HTTP and WebSocket endpoint of a relay process, in one table.

The handlers live beside their subject (``relay.app`` for the public XRPC methods and probes,
``relay.admin`` for ``/admin/``, ``relay.console.api`` and ``relay.dashboard`` for the operator
console, ``firehose.serve_asgi`` and ``relay.jetstream_server`` for the streams); this module only
says which path reaches which handler. Two apps are built from it:

* ``build_app(service)`` — the full surface of a running ``relay.service.RelayService`` (typed as ``relay.service_view.ServiceView``).
  Fan-out processes leave out requestCrawl and the admin API (the ingest owns them).
* ``early_app(service)`` — served by ``relay.gate.ServiceGate`` until the service runs: the
  probes, metrics and console (``probe_routes``, the same route objects the full app mounts), and
  503 ``NotReady`` for anything else.

Every response names the relay (``Server: atproto-relay``, ``relay.siblings.ServerHeader``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from firehose.serve_asgi import SUBSCRIBE_REPOS_PATH, subscribe_repos_endpoint, upgrade_required
from relay import admin, app
from relay.console import api
from relay.consumers import ConsumerTracking
from relay.dashboard import page
from relay.jetstream_server import DICTIONARY_PATH, GET_DICTIONARY_PATH, SUBSCRIBE_PATH, JetstreamServer
from relay.request_guard import RequestGuard
from relay.siblings import ServerHeader
from relay.xrpc import XrpcError

if TYPE_CHECKING:
    from relay.service_view import ServiceView

Endpoint = Callable[[Request], Awaitable[Response]]
#: Methods answered before a WebSocket upgrade (with ``426``-style errors) on a stream's path.
_PRE_UPGRADE = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_NSID = "com.atproto.sync."


def _xrpc(name: str, endpoint: Endpoint, methods: tuple[str, ...] = ("GET", "HEAD")) -> Route:
    return Route(f"/xrpc/{_NSID}{name}", endpoint, methods=list(methods))


def probe_routes() -> list[BaseRoute]:
    """Served in every phase (``relay.gate``): liveness, readiness, metrics and the console."""
    return [
        Route("/_health", app.health),
        Route("/_ready", app.ready),
        Route("/metrics", app.metrics),
        Route("/dashboard", page, methods=["GET", "HEAD"]),
        Route("/dashboard/data", api.data, methods=["GET"]),
        Route("/dashboard/api/hosts", api.hosts, methods=["GET"]),
        Route("/dashboard/api/hosts/{hostname}", api.on_ingest(api.host_detail), methods=["GET"]),
        Route("/dashboard/api/accounts", api.on_ingest(api.accounts), methods=["GET"]),
        Route("/dashboard/api/requestCrawl", api.on_ingest(api.request_crawl), methods=["POST"]),
        Route("/dashboard/api/admin/{rest:path}", api.on_ingest(api.admin_call, checks_token=True),
              methods=["GET", "POST", "DELETE"]),
    ]


def stream_routes(service: ServiceView) -> list[BaseRoute]:
    """subscribeRepos (CBOR frames) and the Jetstream-compatible JSON stream, each consumer
    tracked in ``service.consumers``."""
    routes: list[BaseRoute] = [
        WebSocketRoute(SUBSCRIBE_REPOS_PATH,
                       ConsumerTracking(subscribe_repos_endpoint(service.broadcaster), service.consumers)),
        Route(SUBSCRIBE_REPOS_PATH, upgrade_required, methods=_PRE_UPGRADE),
    ]
    if service.jetstream is not None:
        routes += jetstream_routes(service.jetstream)
    return routes


def jetstream_routes(jetstream: JetstreamServer) -> list[BaseRoute]:
    """``/subscribe`` and its zstd dictionaries."""
    return [
        WebSocketRoute(SUBSCRIBE_PATH, jetstream.websocket_app()),
        Route(SUBSCRIBE_PATH, upgrade_required, methods=_PRE_UPGRADE[:-1]),
        Route(DICTIONARY_PATH, jetstream.dictionary, methods=["GET", "HEAD"]),
        Route(GET_DICTIONARY_PATH, jetstream.dictionary_by_id, methods=["GET", "HEAD"]),
    ]


def public_xrpc_routes() -> list[BaseRoute]:
    """The read-only ``com.atproto.sync.*`` queries (every role)."""
    return [
        _xrpc("listHosts", app.list_hosts),
        _xrpc("getHostStatus", app.get_host_status),
        _xrpc("listRepos", app.list_repos),
        _xrpc("listReposByCollection", app.list_repos_by_collection, ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")),
        _xrpc("getRepoStatus", app.get_repo_status),
        _xrpc("getLatestCommit", app.get_latest_commit),
        _xrpc("getRepo", app.get_repo),
    ]


def admin_routes() -> list[BaseRoute]:
    """``/admin/`` (see ``relay.admin`` for the table of effects). ``forward=True``: passed on
    to the sibling relays once it succeeded here."""
    a = admin.admin_endpoint
    return [
        Route("/admin/hosts", a(admin.list_hosts), methods=["GET"]),
        Route("/admin/hosts", a(admin.add_host), methods=["POST"]),
        Route("/admin/hosts/{hostname}/block", a(admin.block_host, forward=True), methods=["POST"]),
        Route("/admin/hosts/{hostname}/unblock", a(admin.unblock_host, forward=True), methods=["POST"]),
        Route("/admin/hosts/{hostname}/limits", a(admin.set_limits, forward=True), methods=["POST"]),
        Route("/admin/hosts/{hostname}/reset-cursor", a(admin.reset_cursor), methods=["POST"]),
        Route("/admin/hosts/{hostname}/validation", a(admin.set_validation), methods=["POST"]),
        Route("/admin/domain-bans", a(admin.domain_bans), methods=["GET"]),
        Route("/admin/domain-bans", a(admin.domain_bans, forward=True), methods=["POST"]),
        Route("/admin/domain-bans/{domain}", a(admin.remove_domain_ban, forward=True), methods=["DELETE"]),
        Route("/admin/accounts/{did}", a(admin.get_account), methods=["GET"]),
        Route("/admin/desynchronized", a(admin.desynchronized), methods=["GET"]),
        Route("/admin/accounts/{did}/takedown", a(admin.takedown, forward=True), methods=["POST"]),
        Route("/admin/accounts/{did}/reverse-takedown", a(admin.reverse_takedown, forward=True), methods=["POST"]),
        Route("/admin/accounts/{did}/resync", a(admin.resync_account), methods=["POST"]),
        Route("/admin/hosts/{hostname}/resync", a(admin.resync_host), methods=["POST"]),
        Route("/admin/consumers", a(admin.consumers), methods=["GET"]),
        Route("/admin/crawling", a(admin.crawling), methods=["GET", "POST"]),
        Route("/admin/audit", a(admin.audit), methods=["GET"]),
        Route("/admin/{rest:path}", a(admin.unknown), methods=["GET", "POST", "DELETE"]),
    ]


def routes(service: ServiceView) -> list[BaseRoute]:
    """The whole surface of a running relay process, in matching order."""
    table: list[BaseRoute] = [Route("/", app.root), *probe_routes(), *stream_routes(service), *public_xrpc_routes()]
    if service.hosts is not None:  # ingest / serve: they manage hosts
        table.append(_xrpc("requestCrawl", app.request_crawl, ("POST", "GET")))
        table += admin_routes()
    table.append(Route("/xrpc/{method}", app.not_implemented, methods=["GET", "POST"]))
    return table


def build_app(service: ServiceView) -> Starlette:
    """The Starlette app over a running ``service`` (XRPC error bodies for every error)."""
    return _app(service, routes(service), {XrpcError: app.xrpc_error, HTTPException: app.http_error,
                                           Exception: app.server_error},
                [Middleware(ServerHeader), Middleware(RequestGuard)])


def early_app(service: ServiceView) -> Starlette:
    """Probes, metrics and console while the service starts; 503 ``NotReady`` for anything else."""
    table = [*probe_routes(), Route("/{rest:path}", app.not_ready, methods=["GET", "HEAD", "POST", "PUT", "DELETE"])]
    return _app(service, table, {XrpcError: app.xrpc_error}, [Middleware(ServerHeader)])


def _app(service: ServiceView, table: list[BaseRoute],
         handlers: dict[type[Exception], Callable[[Request, Exception], Awaitable[Response]]],
         middleware: list[Middleware]) -> Starlette:
    built = Starlette(routes=table, exception_handlers=dict(handlers), middleware=middleware)
    built.state.service = service
    return built


__all__ = ["admin_routes", "build_app", "early_app", "jetstream_routes", "probe_routes", "routes"]
