"""The relay's public HTTP handlers: XRPC (com.atproto.sync.*), health, readiness, metrics.

Each handler reads the running relay (a ``relay.service_view.ServiceView``) it serves from ``request.app.state.service``;
``relay.routes`` holds the route table and builds the apps.
Public endpoints follow the Lexicons in ``lexicons/com/atproto/sync/`` exactly; errors are
``{"error", "message"}`` with the Lexicon's error names. The admin API lives in ``relay.admin``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

from backfill.types import HostState
from firehose.state import AccountState
from relay.accounts import reported_status
from relay.hosts import CrawlRefused, HostManager, host_base_url
from relay.metrics import CONTENT_TYPE_LATEST
from relay.repo_proxy import RepoRefused, RepoUnavailable
from relay.xrpc import XrpcError, did_param, int_param, invalid, json_object, param

if TYPE_CHECKING:
    from relay.service_view import ServiceView

log = logging.getLogger("relay.app")

NSID = "com.atproto.sync."
#: getLatestCommit / getRepo errors for inactive accounts (Lexicon error names).
_INACTIVE_ERRORS = {
    "takendown": "RepoTakendown",
    "suspended": "RepoSuspended",
    "deactivated": "RepoDeactivated",
    "deleted": "RepoNotFound",
}


def host_view(host: HostState) -> dict[str, object]:
    """``com.atproto.sync.listHosts#host`` / getHostStatus output."""
    return {"hostname": host.hostname, "seq": host.cursor, "accountCount": host.account_count,
            "status": host.status}


def _service(request: Request) -> ServiceView:
    service: ServiceView = request.app.state.service
    return service


def _hosts(request: Request) -> HostManager:
    """The host manager (present on every process that mounts requestCrawl/admin routes)."""
    hosts = _service(request).hosts
    if hosts is None:
        raise XrpcError(501, "MethodNotImplemented", "this process does not manage hosts")
    return hosts


async def _account(request: Request, did: str) -> AccountState:
    state = await _service(request).store.get_account(did)
    if state is None:
        raise XrpcError(400, "RepoNotFound", f"no repository for {did}")
    return state


def _refuse_inactive(state: AccountState) -> None:
    status = state.combined_status
    if status != "active":
        raise XrpcError(400, _INACTIVE_ERRORS.get(status, "RepoNotFound"), f"repository is {status}")


async def list_hosts(request: Request) -> Response:
    limit = int_param(request, "limit", default=200, minimum=1, maximum=1000)
    cursor = param(request, "cursor")
    hosts = await _service(request).store.list_hosts(after=cursor, limit=limit)
    out: dict[str, object] = {"hosts": [host_view(h) for h in hosts]}
    if len(hosts) == limit:
        out["cursor"] = hosts[-1].hostname
    return JSONResponse(out)


async def get_host_status(request: Request) -> Response:
    hostname = (param(request, "hostname", required=True) or "").lower()
    host = await _service(request).store.get_host(hostname)
    if host is None:
        raise XrpcError(400, "HostNotFound", f"unknown host {hostname}")
    return JSONResponse(host_view(host))


async def list_repos(request: Request) -> Response:
    limit = int_param(request, "limit", default=500, minimum=1, maximum=1000)
    cursor = param(request, "cursor")
    store = _service(request).store
    accounts = await store.list_accounts(after_did=cursor, limit=limit)
    repos = []
    for state in accounts:
        if not state.commit_cid or not state.rev:
            continue  # nothing to report for an account we have never seen a commit of
        status = reported_status(state)
        repo: dict[str, object] = {"did": state.did, "head": state.commit_cid, "rev": state.rev,
                                   "active": status == "active"}
        if status != "active":
            repo["status"] = status
        repos.append(repo)
    out: dict[str, object] = {"repos": repos}
    if len(accounts) == limit:
        out["cursor"] = accounts[-1].did
    return JSONResponse(out)


async def list_repos_by_collection(request: Request) -> Response:
    """Active accounts with at least one record in ``collection`` (``backfill.collections``).
    A query: any method but GET/HEAD is ``405 MethodNotAllowed``."""
    from mst.syntax import is_valid_nsid

    if request.method not in ("GET", "HEAD"):
        raise XrpcError(405, "MethodNotAllowed", "listReposByCollection is a query: use GET")
    collection = param(request, "collection", required=True) or ""
    if not is_valid_nsid(collection):
        raise invalid("parameter 'collection' is not a valid NSID")
    limit = int_param(request, "limit", default=500, minimum=1, maximum=2000)
    dids = await _service(request).store.list_repos_by_collection(collection, param(request, "cursor"), limit)
    out: dict[str, object] = {"repos": [{"did": did} for did in dids]}
    if len(dids) == limit:
        out["cursor"] = dids[-1]
    return JSONResponse(out)


async def get_repo_status(request: Request) -> Response:
    did = did_param(request)
    state = await _account(request, did)
    status = reported_status(state)
    out: dict[str, object] = {"did": did, "active": status == "active"}
    if status != "active":
        out["status"] = status
    elif state.rev:
        out["rev"] = state.rev
    return JSONResponse(out)


async def get_latest_commit(request: Request) -> Response:
    did = did_param(request)
    state = await _account(request, did)
    _refuse_inactive(state)
    if not state.commit_cid or not state.rev:
        raise XrpcError(400, "RepoNotFound", f"no commit known for {did}")
    return JSONResponse({"cid": state.commit_cid, "rev": state.rev})


async def get_repo(request: Request) -> Response:
    """A 302 to the account's PDS; with ``RELAY_GETREPO_PROXY`` the verified repository itself
    (``relay.repo_proxy``), falling back to the 302 when the PDS cannot be reached."""
    did = did_param(request)
    since = param(request, "since")
    service = _service(request)
    state = await _account(request, did)
    _refuse_inactive(state)
    pds = None
    try:
        pds = (await service.identity.resolve(did)).pds
    except Exception as exc:  # identity failures fall back to the host the account streams from
        log.info("getRepo identity lookup failed", extra={"fields": {"did": did, "error": str(exc)}})
    if not pds and state.host:
        pds = host_base_url(state.host, insecure=service.config.allow_insecure_hosts)
    if not pds:
        raise XrpcError(400, "RepoNotFound", f"no PDS known for {did}")
    proxy = service.repo_proxy
    if proxy is not None:
        try:
            answer = await proxy.get(did, pds, since=since, known_rev=state.rev)
        except RepoRefused as exc:
            service.metrics.getrepo.labels(result="refused").inc()
            raise XrpcError(502, "UpstreamFailure",
                            f"the repository from the account's PDS failed verification: {exc.reason}") from None
        except RepoUnavailable:
            service.metrics.getrepo.labels(result="fallback_redirect").inc()
        else:
            return Response(answer.car, media_type="application/vnd.ipld.car")
    else:
        service.metrics.getrepo.labels(result="redirect").inc()
    query = {"did": did, **({"since": since} if since else {})}
    return RedirectResponse(f"{pds.rstrip('/')}/xrpc/com.atproto.sync.getRepo?{urlencode(query)}",
                            status_code=302)


async def request_crawl(request: Request) -> Response:
    if request.method != "POST":
        raise XrpcError(405, "InvalidRequest", "requestCrawl is a procedure: use POST")
    body = await json_object(request)
    hostname = body.get("hostname")
    if not isinstance(hostname, str) or not hostname:
        raise invalid("missing required field 'hostname'")
    try:
        await _hosts(request).request_crawl(hostname)
    except CrawlRefused as exc:
        raise XrpcError(400, exc.xrpc_error, f"{exc.reason}: {exc.message}") from None
    siblings = _service(request).siblings
    if siblings is not None:  # accepted here: passed on to the sibling relays (queued, not waited for)
        await siblings.offer(request)
    return JSONResponse({})


async def health(request: Request) -> Response:
    """Liveness: the process and its event loop answer. Depends on nothing else (a database blip
    must not get a healthy relay restarted), so it is 200 in every phase, a standby waiting for
    the writer lease included; ``state`` is the phase (``starting``, ``standby``, ``running``,
    ``stopping``), ``seq`` the last one this process knows of."""
    service = _service(request)
    body: dict[str, object] = {"status": "ok", "version": service.version, "seq": _known_seq(service),
                               "role": service.role, "state": service.phase}
    if service.phase == "standby":
        body["waitingFor"] = service.lease_holder
    return JSONResponse(body)


def _known_seq(service: ServiceView) -> int:
    if service.sequencer is not None and service.sequencer.state not in ("waiting", "stopped"):
        return service.sequencer.high_water
    return service.core.broadcaster.latest_seq if service.core is not None else 0


async def ready(request: Request) -> Response:
    """Readiness: 200 ``{"status": "ready"}`` when the service runs, the store answers, the
    sequencer is running and (scale-out) the bus answers; else 503 with ``reasons`` and ``status``
    ``standby`` (an ingest waiting for the writer lease), ``starting`` or ``degraded``."""
    service = _service(request)
    reasons = await service.readiness()
    phase = service.phase
    status = "ready" if not reasons else ("degraded" if phase == "running" else phase)
    body: dict[str, object] = {"status": status, "role": service.role, "state": phase}
    if service.sequencer is not None:
        body["sequencer"] = service.sequencer.state
        body["seq"] = service.sequencer.high_water
    if reasons:
        body["reasons"] = reasons
    return JSONResponse(body, status_code=503 if reasons else 200)


async def metrics(request: Request) -> Response:
    """Prometheus exposition. The gauges read from the store are refreshed first; the text is
    built in a worker thread (``RelayMetrics.render_off_loop``), so a scrape of thousands of
    hosts' series does not stall ingest or delivery."""
    service = _service(request)
    await service.refresh_gauges()
    return Response(await service.metrics.render_off_loop(), media_type=CONTENT_TYPE_LATEST)


async def not_implemented(request: Request) -> Response:
    method = request.path_params.get("method", "")
    raise XrpcError(501, "MethodNotImplemented", f"{method} is not implemented by this relay")


async def root(request: Request) -> Response:
    return PlainTextResponse(
        "This is an AT Protocol relay.\n"
        "Stream: ws(s)://<this host>/xrpc/com.atproto.sync.subscribeRepos\n"
        "Hosts:  /xrpc/com.atproto.sync.listHosts\n")


async def xrpc_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, XrpcError)
    return exc.response()


#: Starlette's own HTTP errors (no route, wrong method) as XRPC error names.
_HTTP_ERRORS = {404: "NotFound", 405: "MethodNotAllowed"}


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors as XRPC error bodies (it would answer them in plain text)."""
    assert isinstance(exc, HTTPException)
    error = _HTTP_ERRORS.get(exc.status_code, "InvalidRequest" if exc.status_code < 500 else "InternalServerError")
    return JSONResponse({"error": error, "message": exc.detail}, status_code=exc.status_code,
                        headers=exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse({"error": "InternalServerError", "message": "internal error"}, status_code=500)


async def not_ready(request: Request) -> Response:
    """Anything but the probes while the service starts (``relay.gate``): 503 ``NotReady`` with
    the readiness reasons and ``Retry-After``."""
    service = _service(request)
    reasons = await service.readiness()
    return JSONResponse({"error": "NotReady", "message": f"the relay is not running yet ({service.phase})",
                         "reasons": reasons}, status_code=503, headers={"retry-after": "5"})


__all__ = ["host_view"]
