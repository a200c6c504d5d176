"""The operator console's JSON endpoints (mounted by ``relay.dashboard``).

Reads of the overview come from state every replica shares, so the console on any process shows
the whole deployment and keeps working while the ingest is down:

* ``GET /dashboard/data`` — every process's report (``relay.console.reports``: Redis in
  scale-out) with the writer's (the ingest's) numbers on top; public, as before, with the
  admin-only parts (consumers' addresses, desynchronized accounts) only for the admin token;
* ``GET /dashboard/api/hosts`` — the host table: ``?q`` (hostname substring), ``status``,
  ``sort`` (``hostname``, ``status``, ``accounts``, ``rate``, ``eventsIn``, ``cursor``,
  ``rejected``, ``lastSeen``), ``order`` (``asc``/``desc``), ``offset``, ``limit`` (≤ 500), paged
  on the server over the stored hosts (``Store.list_hosts``, read whole at most once per
  ``HostIndex.ttl`` per process) joined with the ingest's per-host frames and rates from its
  report; ``{total, offset, hosts}``. Public, like ``listHosts``.

Everything else needs the admin token and runs on the ingest (the process with the host manager,
the account lanes and the resync queue). A fan-out has none of those: it authenticates the request
itself (so a wrong token is refused and counted there, per client address), then forwards it with
the same ``Authorization`` to ``RELAY_CONSOLE_INGEST_URL`` and answers what the ingest answered
(502 ``IngestUnavailable`` when it cannot be reached; 501 ``ActionsUnavailable`` when the setting
is empty):

* ``GET /dashboard/api/hosts/{hostname}`` — host detail: the admin host view (status, cursor,
  limits, trust), frames in and rate, verdicts other than ``accept`` by reason since start
  (``relay.console.ledger``), the upstream connection (connected, last error, counters);
* ``GET /dashboard/api/accounts?q=`` — a DID, or a handle (resolved, and checked back against the
  DID document): the stored account (statuses, sync state, rev, host) and its resync queue entry;
* ``GET|POST|DELETE /dashboard/api/admin/{path}`` — the admin API's ``/admin/{path}`` (audited
  there): add a host, limits, block/unblock, domain bans, takedowns, resyncs, desynchronized;
* ``POST /dashboard/api/requestCrawl`` — ``com.atproto.sync.requestCrawl``, as a PDS would ask.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backfill.types import HostState
from relay.admin import _admin_host_view, authenticate, authorize
from relay.client_limits import RateLimited
from relay.console.reports import public
from relay.xrpc import XrpcError, int_param

if TYPE_CHECKING:
    from relay.service_view import ServiceView

#: Host table sort keys and how each is read from a row.
SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "hostname": lambda h: h["hostname"],
    "status": lambda h: (h["status"], h["hostname"]),
    "accounts": lambda h: (h["accounts"], h["hostname"]),
    "rate": lambda h: (h["rate"] or 0.0, h["hostname"]),
    "eventsIn": lambda h: (h["eventsIn"], h["hostname"]),
    "cursor": lambda h: (h["cursor"] or 0, h["hostname"]),
    "rejected": lambda h: (h["rejected"], h["hostname"]),
    "lastSeen": lambda h: (h["lastSeen"] or 0.0, h["hostname"]),
}
#: Hosts read from the store per page while the index is rebuilt.
INDEX_PAGE = 1000


def _service(request: Request) -> ServiceView:
    service: ServiceView = request.app.state.service
    return service


class HostIndex:
    """Every stored host with its held (throttled) accounts, read at most once per ``ttl``
    seconds however many console requests ask (one read at a time, shared by the waiters)."""

    def __init__(self, service: ServiceView, ttl: float = 2.0) -> None:
        self.service = service
        self.ttl = ttl
        self._at = 0.0
        self._rows: list[tuple[HostState, int]] = []
        self._lock = asyncio.Lock()

    async def rows(self) -> list[tuple[HostState, int]]:
        async with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                store = self.service.store
                hosts: list[HostState] = []
                after = None
                while True:
                    page = await store.list_hosts(after=after, limit=INDEX_PAGE)
                    hosts += page
                    if len(page) < INDEX_PAGE:
                        break
                    after = page[-1].hostname
                held = await store.count_accounts_by_host("throttled") if hosts else {}
                self._rows = [(h, held.get(h.hostname, 0)) for h in hosts]
                self._at = time.monotonic()
            return self._rows

    def invalidate(self) -> None:
        """The next read goes to the store (an action changed a host)."""
        self._at = 0.0


def admin_level(request: Request, service: ServiceView) -> bool | None:
    """True with the right admin token, False without one (or with the admin API off), None for
    a wrong one. Raises ``RateLimited`` once the client's failures are spent."""
    if not request.headers.get("authorization"):
        return False
    result = authenticate(service, request)
    if result in ("wrong", "missing"):
        return None
    return result == "ok"


def ingest_report(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The writer's report among ``reports``: the process whose sequencer runs (else any with one)."""
    with_sequencer = [r for r in reports if r.get("sequencer")]
    running = [r for r in with_sequencer if r["sequencer"].get("state") == "running"]
    found = running or with_sequencer
    return found[0] if found else None


async def data(request: Request) -> Response:
    """``GET /dashboard/data``: the deployment (see the module docstring)."""
    service = _service(request)
    try:
        admin = admin_level(request, service)
    except RateLimited as exc:
        return exc.response()
    if admin is None:
        return JSONResponse({"error": "InvalidToken", "message": "wrong admin token"}, status_code=403)
    reporter = service.reporter
    reports = await reporter.deployment()
    if not admin:
        reports = [public(r) for r in reports]
    writer = ingest_report(reports)
    consumers: dict[str, dict[str, float]] = {}
    for report in reports:
        for enc, row in report["consumers"]["byEncoding"].items():
            total = consumers.setdefault(enc, {"connected": 0, "bytesSent": 0, "framesSent": 0, "bytesPerSecond": 0.0})
            for key in ("connected", "bytesSent", "framesSent"):
                total[key] += row[key]
            total["bytesPerSecond"] += row.get("bytesPerSecond") or 0.0
    body = {
        "time": time.time(), "self": reporter.id, "admin": admin, "adminEnabled": bool(service.config.admin_token),
        "actions": service.hosts is not None or bool(service.config.console_ingest_url),
        "redisError": reporter.redis_error, "replicas": reports, "writer": writer,
        "consumers": {"count": sum(r["consumers"]["count"] for r in reports), "byEncoding": consumers,
                      "maxLag": max((r["consumers"]["maxLag"] for r in reports), default=0)},
    }
    return JSONResponse(body, headers={"cache-control": "no-store"})


async def hosts(request: Request) -> Response:
    """``GET /dashboard/api/hosts`` (see the module docstring)."""
    service = _service(request)
    q = (request.query_params.get("q") or "").strip().lower()
    status = request.query_params.get("status") or ""
    sort = request.query_params.get("sort") or "hostname"
    if sort not in SORTS:
        raise XrpcError(400, "InvalidRequest", f"sort must be one of {', '.join(SORTS)}")
    order = request.query_params.get("order") or "asc"
    if order not in ("asc", "desc"):
        raise XrpcError(400, "InvalidRequest", "order must be asc or desc")
    offset = int_param(request, "offset", default=0, minimum=0, maximum=10_000_000)
    limit = int_param(request, "limit", default=50, minimum=1, maximum=500)
    try:
        rows = await service.console_hosts.rows()
    except Exception as exc:  # the store is down: say so (readiness has the reason)
        return JSONResponse({"error": "StoreUnavailable", "message": type(exc).__name__}, status_code=503)
    writer = ingest_report(await service.reporter.deployment()) or {}
    live: dict[str, dict[str, Any]] = writer.get("hosts", {})
    out = []
    for host, held in rows:
        if q and q not in host.hostname:
            continue
        if status and host.status != status:
            continue
        seen = live.get(host.hostname, {})
        out.append({"hostname": host.hostname, "status": host.status, "cursor": host.cursor,
                    "accounts": host.account_count, "throttled": held, "lastSeen": host.last_seen,
                    "eventsIn": seen.get("eventsIn", 0.0), "rate": seen.get("rate"),
                    "rejected": seen.get("rejected", 0), "relay": host.relay})
    out.sort(key=SORTS[sort], reverse=order == "desc")
    return JSONResponse({"total": len(out), "offset": offset, "limit": limit, "sort": sort, "order": order,
                         "hosts": out[offset:offset + limit]}, headers={"cache-control": "no-store"})


async def _forward(request: Request, service: ServiceView, path: str) -> Response:
    """Answer ``request`` as ``path`` on the ingest (see the module docstring)."""
    base = service.config.console_ingest_url
    if not base:
        raise XrpcError(501, "ActionsUnavailable",
                        "this process does not manage hosts and RELAY_CONSOLE_INGEST_URL is not set")
    url = base.rstrip("/") + path
    headers = {"authorization": request.headers.get("authorization", "")}
    body = await request.body()
    if body:
        headers["content-type"] = "application/json"
    try:
        async with httpx.AsyncClient(timeout=60.0) as client:
            answer = await client.request(request.method, url, params=dict(request.query_params),
                                          content=body or None, headers=headers)
    except httpx.HTTPError as exc:
        raise XrpcError(502, "IngestUnavailable", f"the ingest did not answer: {type(exc).__name__}") from None
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))


def on_ingest(handler: Callable[[Request, ServiceView], Awaitable[Response]], *,
              checks_token: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """An admin-only console endpoint: run here on a process with the host manager, else
    authorised here and forwarded to the same path on the ingest (which runs it there).
    ``checks_token``: the handler runs the admin API, which authorises the request itself (so
    it is checked, and counted, once)."""

    async def endpoint(request: Request) -> Response:
        service = _service(request)
        if service.hosts is None:
            authorize(request)
            return await _forward(request, service, request.url.path)
        if not checks_token:
            authorize(request)
        return await handler(request, service)

    return endpoint


async def _in_process(request: Request, service: ServiceView, path: str) -> Response:
    """``request`` answered by this process's own app as ``path`` (the admin API or requestCrawl:
    their validation, audit and errors, unchanged)."""
    assert service.app is not None
    client = request.client.host if request.client else "127.0.0.1"
    transport = httpx.ASGITransport(app=service.app, client=(client, 0))
    headers = {"authorization": request.headers.get("authorization", ""), "content-type": "application/json"}
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as client_:
        answer = await client_.request(request.method, path, params=dict(request.query_params),
                                       content=await request.body() or None, headers=headers)
    service.console_hosts.invalidate()
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))


def _admin_path(request: Request) -> str:
    rest: str = request.path_params["rest"]
    return "/admin/" + rest


async def admin_call(request: Request, service: ServiceView) -> Response:
    return await _in_process(request, service, _admin_path(request))


async def request_crawl(request: Request, service: ServiceView) -> Response:
    return await _in_process(request, service, "/xrpc/com.atproto.sync.requestCrawl")


async def host_detail(request: Request, service: ServiceView) -> Response:
    hostname = request.path_params["hostname"].lower()
    host = await service.store.get_host(hostname)
    if host is None:
        raise XrpcError(404, "NotFound", f"unknown host {hostname}")
    report = await service.reporter.local()
    seen = report["hosts"].get(hostname, {})
    upstreams = service.upstreams
    return JSONResponse({**_admin_host_view(service, host), "eventsIn": seen.get("eventsIn", 0.0),
                         "rate": seen.get("rate"), "verdicts": service.host_ledger.of(hostname),
                         "connection": upstreams.connection(hostname) if upstreams is not None else None},
                        headers={"cache-control": "no-store"})


async def accounts(request: Request, service: ServiceView) -> Response:
    q = (request.query_params.get("q") or "").strip()
    if not q:
        raise XrpcError(400, "InvalidRequest", "q (a DID or a handle) required")
    if q.startswith("did:"):
        did: str | None = q
    else:
        did = await service.identity.resolve_handle(q)
        if did is None:
            return JSONResponse({"query": q, "accounts": [], "message": f"handle {q} does not resolve to a DID "
                                 "whose document claims it"})
    assert did is not None
    state = await service.store.get_account(did)
    if state is None:
        return JSONResponse({"query": q, "accounts": [], "message": f"the relay holds no account {did}"})
    handle = None
    try:
        handle = (await service.identity.resolve(did)).handle
    except Exception:  # the directory may be down: the account is shown without its handle
        handle = None
    entry = service.resync.queue.entry(did) if service.resync is not None else None
    return JSONResponse({"query": q, "accounts": [{
        "did": did, "handle": handle, "host": state.host, "status": state.combined_status,
        "upstreamStatus": state.upstream_status, "localStatus": state.local_status, "syncState": state.sync_state,
        "rev": state.rev, "head": state.commit_cid, "updatedAt": state.updated_at,
        "resync": None if entry is None else {"since": entry.since, "state": entry.state, "attempts": entry.attempts,
                                              "lastFailure": entry.last_failure, "lastError": entry.last_error,
                                              "nextRetry": entry.next_retry}}]})
