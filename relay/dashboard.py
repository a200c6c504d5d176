"""Operator console: ``GET /dashboard`` (routes in ``relay.routes``) (one self-contained HTML page, ``relay/console/console.html``)
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

_PAGE = resources.files("relay.console").joinpath("console.html")


async def page(request: Request) -> Response:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})
