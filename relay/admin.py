"""Admin API under ``/admin/``: ``Authorization: Bearer $RELAY_ADMIN_TOKEN``.

The token is compared in constant time (``hmac.compare_digest``). Without a configured token the
whole admin API answers 404 ``AdminDisabled``. A missing token answers 401 ``AuthRequired``, a
wrong one 403 ``InvalidToken``. Failed authentications are limited per client address
(``RELAY_ADMIN_AUTH_FAILURES_PER_MINUTE``, a token bucket): once a client has spent them, every
admin request from it, and every dashboard request carrying a token — with the right one or not,
so guessing gains nothing — is answered 429 ``RateLimitExceeded`` with ``Retry-After`` until it may try again (counted
``relay_admin_requests_total{result="rate_limited"}``). :func:`authenticate` is that check, for
the admin API and the dashboard alike; each ``RelayService`` has one failure table
(:func:`auth_limiter`, made on first use). Bodies are JSON; errors are ``{error, message}``.

| method | path | body / effect |
| --- | --- | --- |
| GET | /admin/hosts | ``?cursor&limit`` list hosts (with limits) |
| POST | /admin/hosts | ``{hostname, account_limit?, trusted?, relay?}`` add (skips crawl switch/limit; ``relay``: the host is another relay) |
| POST | /admin/hosts/{hostname}/block · /unblock | ban / re-admit a host |
| POST | /admin/hosts/{hostname}/limits | ``{account_limit?, trusted?, rate_limit_per_second?, …_per_hour?, …_per_day?}`` |
| POST | /admin/hosts/{hostname}/reset-cursor | ``{cursor?: 0}`` resubscribe from there |
| POST | /admin/hosts/{hostname}/validation | ``{lenient: true|false|null}`` sync 1.0 commits: lenient, strict, or per ``RELAY_LENIENT_SYNC_VALIDATION`` |
| GET/POST | /admin/domain-bans | list / ``{domain}`` ban (blocks matching hosts) |
| DELETE | /admin/domain-bans/{domain} | lift a ban |
| POST | /admin/accounts/{did}/takedown · /reverse-takedown | emits ``#account`` |
| POST | /admin/accounts/{did}/resync | mark the account desynchronized and queue its resync (full fetch + verify, then ``#sync``) |
| POST | /admin/hosts/{hostname}/resync | the same for every account the relay holds on the host: ``{queued}`` |
| GET | /admin/accounts/{did} | stored account state |
| GET | /admin/desynchronized | ``?limit`` accounts waiting for a resync, longest first: since when, failed attempts, last failure, next retry |
| GET | /admin/consumers | connected subscribeRepos consumers |
| GET/POST | /admin/crawling | ``{enabled}`` public requestCrawl on/off |
| GET | /admin/audit | recent admin actions |

Changes marked in ``relay.routes`` with ``forward=True`` (limits, block/unblock, domain bans,
takedowns) are passed on to the sibling relays once they succeed here (``relay.siblings``).
"""

from __future__ import annotations

import hmac
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from relay.client_limits import ClientRateLimiter, RateLimited
from relay.hosts import CrawlRefused
from relay.jsonlog import fields
from relay.xrpc import XrpcError, int_param, invalid, json_object

if TYPE_CHECKING:
    from backfill.types import HostState
    from firehose.state import AccountState
    from relay.hosts import HostManager
    from relay.service_view import ServiceView

log = logging.getLogger("relay.admin")

#: An admin endpoint: the request (already authorized) and the service it administers.
AdminHandler = Callable[[Request, "ServiceView"], Awaitable[Response]]


def _service(request: Request) -> ServiceView:
    service: ServiceView = request.app.state.service
    return service


def _hosts(service: ServiceView) -> HostManager:
    """The service's host manager: the admin API is mounted only when there is one."""
    assert service.hosts is not None, "admin API without a host manager"
    return service.hosts


def check_token(configured: str, header: str | None) -> str:
    """``ok`` | ``disabled`` | ``missing`` | ``wrong`` for an Authorization header value."""
    if not configured:
        return "disabled"
    if not header:
        return "missing"
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "missing"
    if hmac.compare_digest(token.strip().encode(), configured.encode()):
        return "ok"
    return "wrong"


_auth_limiters: weakref.WeakKeyDictionary[ServiceView, ClientRateLimiter] = weakref.WeakKeyDictionary()


def auth_limiter(service: ServiceView) -> ClientRateLimiter:
    """``service``'s table of failed admin authentications per client address."""
    found = _auth_limiters.get(service)
    if found is None:
        found = _auth_limiters[service] = ClientRateLimiter(service.config.admin_auth_failures_per_minute)
    return found


def authenticate(service: ServiceView, request: Request) -> str:
    """``check_token`` for ``request``, counted in ``relay_admin_requests_total{result}``, under the
    per-client failure limit: raises ``RateLimited`` while the client has no failures left, and a
    ``missing`` or ``wrong`` result spends one of them."""
    limiter = auth_limiter(service)
    client = request.client.host if request.client else "unknown"
    if service.config.admin_token and (wait := limiter.wait(client)):
        service.metrics.admin_requests.labels(result="rate_limited").inc()
        raise RateLimited(wait, "too many failed admin authentications from this address")
    result = check_token(service.config.admin_token, request.headers.get("authorization"))
    service.metrics.admin_requests.labels(result=result).inc()
    if result in ("missing", "wrong"):
        limiter.take(client)
        log.warning("admin authentication failed", extra=fields(client=client, result=result))
    return result


def authorize(request: Request) -> None:
    """Refuse ``request`` unless it carries the admin token: 404 ``AdminDisabled``, 401
    ``AuthRequired`` or 403 ``InvalidToken`` (:func:`authenticate`: counted and rate-limited)."""
    result = authenticate(_service(request), request)
    if result == "disabled":
        raise XrpcError(404, "AdminDisabled", "the admin API is off (set RELAY_ADMIN_TOKEN)")
    if result == "missing":
        raise XrpcError(401, "AuthRequired", "Authorization: Bearer <RELAY_ADMIN_TOKEN> required")
    if result == "wrong":
        raise XrpcError(403, "InvalidToken", "wrong admin token")


#: The largest integer a body field may hold (what both stores' BIGINT/INTEGER columns can).
MAX_INT = 2**63 - 1


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
        raise invalid(f"{key} must be an integer from 0 to {MAX_INT}")
    return value


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{key} must be true or false")
    return value


def _admin_host_view(service: ServiceView, host: HostState) -> dict[str, Any]:
    return {"hostname": host.hostname, "status": host.status, "seq": host.cursor,
            "accountCount": host.account_count, "accountLimit": _hosts(service).account_limit(host),
            "trusted": _hosts(service).is_trusted(host), "lastSeen": host.last_seen,
            "rateLimits": {"perSecond": host.rate_limit_per_second, "perHour": host.rate_limit_per_hour,
                           "perDay": host.rate_limit_per_day},
            "relay": host.relay, "lenient": host.lenient,
            "lenientEffective": service.config.lenient_sync_validation if host.lenient is None else host.lenient,
            "createdAt": host.created_at}


def admin_endpoint(handler: AdminHandler, *, forward: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Wrap ``handler`` as a route endpoint: authorize, then map ``KeyError`` to 404 ``NotFound``
    and ``CrawlRefused`` to 400 with its XRPC error name. ``forward``: a change that succeeded is
    passed on to the sibling relays (``relay.siblings``; queued, never waited for)."""

    async def wrapped(request: Request) -> Response:
        authorize(request)
        service = _service(request)
        try:
            response = await handler(request, service)
        except KeyError as exc:
            raise XrpcError(404, "NotFound", f"unknown {exc.args[0]}") from None
        except CrawlRefused as exc:
            raise XrpcError(400, exc.xrpc_error, f"{exc.reason}: {exc.message}") from None
        if forward and response.status_code < 300 and service.siblings is not None:
            await service.siblings.offer(request)
        return response

    return wrapped


async def list_hosts(request: Request, service: ServiceView) -> Response:
    limit = int_param(request, "limit", default=500, minimum=1, maximum=1000)
    hosts = await service.store.list_hosts(after=request.query_params.get("cursor"), limit=limit)
    out: dict[str, Any] = {"hosts": [_admin_host_view(service, h) for h in hosts]}
    if len(hosts) == limit:
        out["cursor"] = hosts[-1].hostname
    return JSONResponse(out)


async def add_host(request: Request, service: ServiceView) -> Response:
    body = await json_object(request)
    hostname = body.get("hostname")
    if not isinstance(hostname, str):
        raise invalid("hostname required")
    host = await _hosts(service).add_host(hostname, account_limit=_opt_int(body, "account_limit"),
                                          trusted=bool(_opt_bool(body, "trusted")),
                                          relay=bool(_opt_bool(body, "relay")))
    return JSONResponse(_admin_host_view(service, host))


async def block_host(request: Request, service: ServiceView) -> Response:
    host = await _hosts(service).block(request.path_params["hostname"])
    return JSONResponse(_admin_host_view(service, host))


async def unblock_host(request: Request, service: ServiceView) -> Response:
    host = await _hosts(service).unblock(request.path_params["hostname"])
    return JSONResponse(_admin_host_view(service, host))


async def set_limits(request: Request, service: ServiceView) -> Response:
    body = await json_object(request)
    rates = {w: v for w in ("per_second", "per_hour", "per_day")
             if (v := _opt_int(body, f"rate_limit_{w}")) is not None}
    host = await _hosts(service).set_limits(request.path_params["hostname"],
                                            account_limit=_opt_int(body, "account_limit"),
                                            trusted=_opt_bool(body, "trusted"), rate_limits=rates)
    return JSONResponse(_admin_host_view(service, host))


async def reset_cursor(request: Request, service: ServiceView) -> Response:
    body = await json_object(request)
    cursor = _opt_int(body, "cursor") or 0
    host = await _hosts(service).reset_cursor(request.path_params["hostname"], cursor)
    return JSONResponse(_admin_host_view(service, host))


async def set_validation(request: Request, service: ServiceView) -> Response:
    body = await json_object(request)
    if "lenient" not in body:
        raise invalid("lenient (true, false, or null for the relay setting) required")
    host = await _hosts(service).set_validation(request.path_params["hostname"], _opt_bool(body, "lenient"))
    return JSONResponse(_admin_host_view(service, host))


async def domain_bans(request: Request, service: ServiceView) -> Response:
    if request.method == "POST":
        body = await json_object(request)
        domain = body.get("domain")
        if not isinstance(domain, str):
            raise invalid("domain required")
        blocked = await _hosts(service).ban_domain(domain)
        return JSONResponse({"domain": domain.strip().lower().strip("."), "blockedHosts": blocked})
    return JSONResponse({"domains": await service.store.list_domain_bans()})


async def remove_domain_ban(request: Request, service: ServiceView) -> Response:
    removed = await _hosts(service).unban_domain(request.path_params["domain"])
    if not removed:
        raise KeyError(request.path_params["domain"])
    return JSONResponse({"removed": True})


def _account_view(state: AccountState) -> dict[str, Any]:
    return {"did": state.did, "host": state.host, "upstreamStatus": state.upstream_status,
            "localStatus": state.local_status, "status": state.combined_status, "rev": state.rev,
            "head": state.commit_cid, "syncState": state.sync_state}


async def get_account(request: Request, service: ServiceView) -> Response:
    state = await service.store.get_account(request.path_params["did"])
    if state is None:
        raise KeyError(request.path_params["did"])
    return JSONResponse(_account_view(state))


async def desynchronized(request: Request, service: ServiceView) -> Response:
    """The resync queue (``relay.ingest.resync_queue``): each account with when it was marked
    desynchronized, its state (``queued``, ``running``, ``waiting``), failed attempts, the last
    failure's reason and message, and when the next attempt starts (epoch seconds, like the host
    views' times; null unless waiting). ``count`` is the whole queue's size."""
    assert service.resync is not None, "admin API without a resync manager"
    limit = int_param(request, "limit", default=1000, minimum=1, maximum=10_000)
    queue = service.resync.queue
    entries = queue.entries()
    return JSONResponse({"count": len(entries), "accounts": [
        {"did": e.did, "since": e.since, "state": e.state, "attempts": e.attempts, "lastFailure": e.last_failure,
         "lastError": e.last_error, "nextRetry": e.next_retry} for e in entries[:limit]]})


async def takedown(request: Request, service: ServiceView) -> Response:
    state = await service.set_local_status(request.path_params["did"], "takendown")
    return JSONResponse(_account_view(state))


async def reverse_takedown(request: Request, service: ServiceView) -> Response:
    state = await service.set_local_status(request.path_params["did"], "active")
    return JSONResponse(_account_view(state))


async def resync_account(request: Request, service: ServiceView) -> Response:
    """Queue a stored account for a resync (404 for an account the relay does not hold)."""
    did = request.path_params["did"]
    if await service.store.get_account(did) is None:
        raise KeyError(did)
    assert service.lanes is not None, "admin API without account lanes"
    await service.lanes.mark_for_resync(did, None)
    await _hosts(service).record_action("resync_account", did)
    state = await service.store.get_account(did)
    assert state is not None
    return JSONResponse(_account_view(state))


#: Accounts read per page while a host's accounts are queued for a resync.
RESYNC_PAGE = 1000


async def resync_host(request: Request, service: ServiceView) -> Response:
    """Queue every account the relay holds on the host for a resync: the account table is read in
    pages of ``RESYNC_PAGE`` (the whole table: a long request on a large relay). ``{queued}``."""
    hostname = request.path_params["hostname"].lower()
    if await service.store.get_host(hostname) is None:
        raise KeyError(hostname)
    assert service.lanes is not None, "admin API without account lanes"
    queued, after = 0, None
    while True:
        page = await service.store.list_accounts(after_did=after, limit=RESYNC_PAGE)
        for state in page:
            if state.host == hostname:
                await service.lanes.mark_for_resync(state.did, hostname)
                queued += 1
        if len(page) < RESYNC_PAGE:
            break
        after = page[-1].did
    await _hosts(service).record_action("resync_host", hostname, queued=queued)
    return JSONResponse({"hostname": hostname, "queued": queued})


async def consumers(request: Request, service: ServiceView) -> Response:
    return JSONResponse({"consumers": service.consumers.list()})


async def crawling(request: Request, service: ServiceView) -> Response:
    hosts = _hosts(service)
    if request.method == "POST":
        enabled = _opt_bool(await json_object(request), "enabled")
        if enabled is None:
            raise invalid("enabled (true/false) required")
        await hosts.set_crawling(enabled)
    return JSONResponse({"enabled": hosts.crawling_enabled, "source": hosts.crawling_source})


async def audit(request: Request, service: ServiceView) -> Response:
    return JSONResponse({"actions": await service.store.list_admin_actions(200)})


async def unknown(request: Request, service: ServiceView) -> Response:
    raise XrpcError(404, "NotFound", f"no admin endpoint {request.url.path}")
