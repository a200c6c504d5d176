"""Operator dashboard: ``GET /dashboard`` (one self-contained HTML page) polling
``GET /dashboard/data`` (JSON).

The numbers come from the same sources as ``/metrics`` — the process's Prometheus registry, read
after the same gauge refresh a scrape does — plus the stored hosts and the broadcaster's
sessions, so what the page shows can be checked against ``/metrics`` line by line. Each process
shows itself: in scale-out, hosts and ingest on the ingest process, consumers on each fan-out
(the Grafana dashboard in ``helm/`` aggregates every pod).

Access. The read-only view is public, like ``/metrics`` and ``listHosts``: it holds nothing those do
not already publish (host names, counters, consumers' lag without who they are). With the admin
token (``Authorization: Bearer``, which the page sends once an operator has typed the token in)
the data adds the consumers' addresses and user agents (``/admin/consumers`` keeps those
admin-only too), and the page offers the mutating actions (block / unblock a host, public crawling
on / off), which it performs through the admin API, so they are authorised there. A wrong token is
answered 403 (never silently downgraded).
"""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from relay.admin import authenticate
from relay.client_limits import RateLimited

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from relay.service import RelayService

#: Hosts listed on the page (the first ones by name).
MAX_HOSTS = 500
_PAGE = resources.files("relay").joinpath("dashboard.html")


def samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of ``registry`` by sample name (``relay_verdicts_total``, ``…_bucket``, …)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _value(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def _by(found: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in found.get(name, []):
        out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def _admin(request: Request, service: RelayService) -> bool | None:
    """True with the right admin token, False without one (or with the admin API off), None for
    a wrong one."""
    if not request.headers.get("authorization"):
        return False
    result = authenticate(service, request)  # RateLimited once the client's failures are spent
    if result in ("wrong", "missing"):
        return None
    return result == "ok"


async def snapshot(service: RelayService, *, admin: bool) -> dict[str, Any]:
    """The dashboard's data (see the module docstring)."""
    reasons = await service.readiness()  # also refreshes relay_current_seq, store and sequencer gauges
    hosts_out: list[dict[str, Any]] = []
    hosts_error = None
    if service.store is not None:
        try:
            if service.hosts is not None:
                await service.hosts.refresh_status_gauge()
            found_hosts = await service.store.list_hosts(after=None, limit=MAX_HOSTS)
            held = await service.store.count_accounts_by_host("throttled") if found_hosts else {}
        except Exception as exc:  # the store is down: the page says so (readiness has the reason)
            hosts_error = type(exc).__name__
        else:
            hosts_out = [{"hostname": h.hostname, "status": h.status, "cursor": h.cursor,
                          "accounts": h.account_count, "throttled": held.get(h.hostname, 0),
                          "lastSeen": h.last_seen} for h in found_hosts]
    found = samples(service.metrics.registry)
    events_in = _by(found, "relay_events_in_total", "host")
    for host in hosts_out:
        host["eventsIn"] = events_in.get(host["hostname"], 0.0)
    latency = {"count": _value(found, "relay_ingest_to_broadcast_seconds_count"),
               "sum": _value(found, "relay_ingest_to_broadcast_seconds_sum"),
               "buckets": [[lab["le"], v] for lab, v in found.get("relay_ingest_to_broadcast_seconds_bucket", [])]}
    broadcaster = service.broadcaster
    head = broadcaster.latest_seq if broadcaster is not None else 0
    sessions = broadcaster.sessions if broadcaster is not None else ()
    consumers: dict[str, Any] = {
        "count": len(sessions),
        "sessions": sorted(({"lag": max(0, head - (s.last_seq if s.last_seq is not None else head)),
                             "lastSeq": s.last_seq, "cursor": s.cursor, "framesSent": s.sent,
                             "bytesSent": s.bytes_sent} for s in sessions), key=lambda s: -s["lag"]),
        "broadcastSeq": head,
    }
    if admin:
        consumers["connections"] = service.consumers.list()
    sequencer = service.sequencer
    return {
        "time": time.time(),
        "relay": {"role": service.role, "state": service.phase, "version": service.version,
                  "ready": not reasons, "reasons": reasons, "waitingFor": service.lease_holder,
                  "admin": admin, "adminEnabled": bool(service.config.admin_token)},
        "seq": _value(found, "relay_current_seq"),
        "sequencer": {"state": sequencer.state if sequencer is not None else None,
                      "secondsSinceLastCommit": _value(found, "relay_last_sequenced_age_seconds")},
        "store": {"up": _value(found, "relay_store_up") == 1, "backend": getattr(service.store, "backend", None)},
        "bus": {"kind": "redis" if service.config.redis_url else "in-process",
                "events": _by(found, "relay_broadcast_events_total", "event")},
        "ingest": {"eventsIn": sum(events_in.values()),
                   "verdicts": [{"kind": lab["kind"], "reason": lab["reason"], "count": v}
                                for lab, v in found.get("relay_verdicts_total", [])],
                   "sequenced": _by(found, "relay_events_sequenced_total", "type")},
        "latency": latency,
        "hosts": hosts_out,
        "hostsError": hosts_error,
        "hostsLimit": MAX_HOSTS,
        "hostStatuses": _by(found, "relay_hosts", "status"),
        "consumers": consumers,
        "resync": {"queue": _value(found, "relay_resync_queue"),
                   "results": _by(found, "relay_resyncs_total", "result")},
        "crawling": (None if service.hosts is None else
                     {"enabled": service.hosts.crawling_enabled, "source": service.hosts.crawling_source}),
    }


async def page(request: Request) -> Response:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})


async def data(request: Request) -> Response:
    service: RelayService = request.app.state.service
    try:
        admin = _admin(request, service)
    except RateLimited as exc:
        return exc.response()
    if admin is None:
        return JSONResponse({"error": "InvalidToken", "message": "wrong admin token"}, status_code=403)
    body = await snapshot(service, admin=admin)
    return JSONResponse(body, headers={"cache-control": "no-store"})


def dashboard_routes() -> list[BaseRoute]:
    return [Route("/dashboard", page, methods=["GET", "HEAD"]),
            Route("/dashboard/data", data, methods=["GET"])]
