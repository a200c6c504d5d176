"""Operator console: ``GET /dashboard`` (one self-contained HTML page, ``relay/console/console.html``)
over the JSON endpoints of ``relay.console.api``.

What the page shows, and where it comes from: every process of the deployment (its report:
``relay.console.reports``, shared through Redis in scale-out), the writer's ingest rate, verdicts,
sequenced events and latency, the consumers with the bytes actually written to them per encoding
(counters since each process started, rates over the last interval), and the host table (search,
sort, pages served by the server). With the admin token: host detail (limits, verdicts by reason,
last connection error), account search by DID or handle, desynchronized accounts by age, and the
actions — add a host, requestCrawl, limits, block / unblock, ban / unban a domain, takedown /
restore, resync an account or a host, public crawling on / off — each performed through the admin
API on the ingest (forwarded there from a fan-out), so authorised and audited there.

Access. The overview and the host table are public, like ``/metrics`` and ``listHosts``: they hold
nothing those do not already publish. The admin token (``Authorization: Bearer``, sent by the page
once an operator has typed it in; kept in the tab's session storage) adds the rest. A wrong token
is answered 403 (never silently downgraded); failures are limited per client address as for the
admin API (``relay.admin.authenticate``).
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

from relay.console import api

_PAGE = resources.files("relay.console").joinpath("console.html")


async def page(request: Request) -> Response:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})


def dashboard_routes() -> list[BaseRoute]:
    """The console's routes (one block: the page, its data, and the admin-only API)."""
    return [
        Route("/dashboard", page, methods=["GET", "HEAD"]),
        Route("/dashboard/data", api.data, methods=["GET"]),
        Route("/dashboard/api/hosts", api.hosts, methods=["GET"]),
        Route("/dashboard/api/hosts/{hostname}", api.on_ingest(api.host_detail), methods=["GET"]),
        Route("/dashboard/api/accounts", api.on_ingest(api.accounts), methods=["GET"]),
        Route("/dashboard/api/requestCrawl", api.on_ingest(api.request_crawl), methods=["POST"]),
        Route("/dashboard/api/admin/{rest:path}", api.on_ingest(api.admin_call, checks_token=True),
              methods=["GET", "POST", "DELETE"]),
    ]
