"""Fuzzing the whole HTTP surface (XRPC methods from the Lexicons, every admin route) on both
stores: no request may get a 500, and every error is an XRPC error body. Then the two pieces
that make it so for bodies and NULs, request by request: ``RequestGuard`` and ``json_object``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from firehose.state import AccountState
from relay.request_guard import MAX_BODY_BYTES, RequestGuard
from relay.routes import admin_routes
from relay.ssrf import static_resolver
from relay.xrpc import XrpcError, json_object
from tests.relay.fuzz import FuzzRequest, Generator, load_methods

TOKEN = "fuzz-token"
DIDS = ["did:plc:aaaaaaaaaaaaaaaaaaaaaaaa", "did:plc:bbbbbbbbbbbbbbbbbbbbbbbb"]
HOSTS = ["pds.example.com", "other.example.org"]
CID = "bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm"
REQUESTS = 1500  # per store
#: Requests that must each be a 4xx, whatever the generator does (the findings of the issue).
KNOWN_HOSTILE = [
    FuzzRequest("POST", "/xrpc/com.atproto.sync.requestCrawl", {"content-type": "application/json"},
                b"[" * 100_000 + b"]" * 100_000),
    FuzzRequest("POST", "/xrpc/com.atproto.sync.requestCrawl", {"content-type": "application/json"},
                b'{"hostname":' * 20_000 + b"1" + b"}" * 20_000),
    FuzzRequest("GET", "/xrpc/com.atproto.sync.listRepos?cursor=did%3Aplc%3A%00", {}),
    FuzzRequest("GET", "/xrpc/com.atproto.sync.listHosts?cursor=%00", {}),
    FuzzRequest("GET", "/xrpc/com.atproto.sync.getHostStatus?hostname=a%00b", {}),
    FuzzRequest("GET", "/xrpc/com.atproto.sync.getRepoStatus?did=did%3Aplc%3Aa%00", {}),
    FuzzRequest("POST", "/admin/domain-bans", {"authorization": f"Bearer {TOKEN}"}, b'{"domain": "a\\u0000.com"}'),
    FuzzRequest("POST", "/admin/hosts/pds.example.com/reset-cursor", {"authorization": f"Bearer {TOKEN}"},
                b'{"cursor": 100000000000000000000000000}'),
    FuzzRequest("GET", "/admin/accounts/did%3Aplc%3A%00", {"authorization": f"Bearer {TOKEN}"}),
    FuzzRequest("POST", "/admin/hosts", {"authorization": f"Bearer {TOKEN}"}, b'{"hostname": "x' + b"y" * 70_000 + b'"}'),
]


def _admin_surface() -> list[tuple[str, str]]:
    out = []
    for route in admin_routes():
        assert isinstance(route, Route) and route.methods is not None
        out += [(m, route.path) for m in sorted(route.methods) if m != "HEAD"]
    return out


def _check(req: FuzzRequest, response: httpx.Response, index: int) -> None:
    where = f"request {index}: {req.describe()} -> {response.status_code} {response.text[:300]}"
    assert response.status_code != 500, where
    if response.status_code >= 400:
        body = json.loads(response.content)
        assert isinstance(body.get("error"), str) and isinstance(body.get("message"), str), where
        assert response.status_code < 500 or body["error"] == "MethodNotImplemented", where


async def test_fuzz_xrpc_and_admin_no_500(relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    settings = {"database_url": database_url, "admin_token": TOKEN, "plc_url": "http://127.0.0.1:9"}
    async with relay_factory(resolver=static_resolver({}), **settings) as relay:
        store = relay.service.store
        for i, did in enumerate(DIDS):
            await store.upsert_account(AccountState(did=did, host=HOSTS[i], rev="3lmxjza3nva27", commit_cid=CID,
                                                    data_cid=CID))
        gen = Generator(20240614, load_methods(), _admin_surface(), token=TOKEN, dids=DIDS, hostnames=HOSTS)
        requests = KNOWN_HOSTILE + [gen.next() for _ in range(REQUESTS)]
        statuses: dict[int, int] = {}
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:

            async def one(index: int, req: FuzzRequest) -> None:
                try:
                    response = await http.request(req.method, req.path, headers=req.headers, content=req.content)
                except httpx.HTTPError as exc:
                    raise AssertionError(f"request {index}: {req.describe()} -> {exc!r}") from exc
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if index < len(KNOWN_HOSTILE):
                    assert 400 <= response.status_code < 500, f"{req.describe()} -> {response.status_code}"
                _check(req, response, index)

            for start in range(0, len(requests), 8):
                await asyncio.gather(*(one(start + i, r) for i, r in enumerate(requests[start:start + 8])))
        # the generator reached the handlers, not only the front door
        assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 50 and statuses.get(413, 0) > 5, statuses


# --- RequestGuard and json_object, request by request -------------------------------------------

LIMIT = 100
NUL = {"error": "InvalidRequest", "message": "NUL characters are not allowed in a request"}
TOO_LARGE = {"error": "PayloadTooLarge", "message": f"request body over {LIMIT} bytes"}


def _echo_app(max_body: int | None = LIMIT) -> tuple[Starlette, list[dict[str, Any]]]:
    """A Starlette app behind ``RequestGuard`` (as ``relay.app`` builds it) whose one route answers
    the body ``json_object`` read; ``seen`` lists what reached it."""
    seen: list[dict[str, Any]] = []

    async def echo(request: Request) -> Response:
        body = await json_object(request)
        seen.append(body)
        return JSONResponse(body)

    async def xrpc_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, XrpcError)
        return exc.response()

    guard = Middleware(RequestGuard) if max_body is None else Middleware(RequestGuard, max_body=max_body)
    app = Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"])],
                    exception_handlers={XrpcError: xrpc_error}, middleware=[guard])
    return app, seen


async def _call(app: Any, *, path: str = "/echo", query: bytes = b"", headers: list[tuple[bytes, bytes]] = (),
                chunks: list[bytes] = ()) -> tuple[int, Any]:
    """One HTTP request straight through the ASGI interface: the body as the given messages."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": list(headers), "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    pending: list[Message] = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                              for i, c in enumerate(chunks)] or [{"type": "http.request"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return status, json.loads(body)


async def test_request_guard_refuses_nul_anywhere_in_path_or_query() -> None:
    app, seen = _echo_app()
    for path, query in (("/echo\x00", b""), ("/echo", b"a=%00"), ("/echo", b"a=\x00b")):
        assert await _call(app, path=path, query=query) == (400, NUL), (path, query)
    assert seen == []
    assert await _call(app, query=b"a=%01&b=%2500") == (200, {})  # neither is a NUL
    assert seen == [{}]


async def test_request_guard_announced_length() -> None:
    """A malformed ``Content-Length`` is a 400, one over the limit a 413 before anything is read;
    the limit is inclusive (and ``MAX_BODY_BYTES`` by default)."""
    app, seen = _echo_app()
    malformed = {"error": "InvalidRequest", "message": "malformed Content-Length"}
    for value in (b"abc", b"-5", b"1e3"):
        assert await _call(app, headers=[(b"content-length", value)], chunks=[b"{}"]) == (400, malformed)
    assert await _call(app, headers=[(b"content-length", b"101")], chunks=[b"{}"]) == (413, TOO_LARGE)
    assert seen == []
    exact = b'{"a": "' + b"x" * (LIMIT - 9) + b'"}'
    assert len(exact) == LIMIT
    assert await _call(app, headers=[(b"content-length", b" 100 ")], chunks=[exact]) == (200, {"a": "x" * 91})
    default, _ = _echo_app(None)
    big = b'{"a": "' + b"x" * (MAX_BODY_BYTES - 9) + b'"}'
    length = str(MAX_BODY_BYTES).encode()
    assert (await _call(default, headers=[(b"content-length", length)], chunks=[big]))[0] == 200
    status, body = await _call(default, headers=[(b"content-length", str(MAX_BODY_BYTES + 1).encode())], chunks=[big])
    assert (status, body["error"]) == (413, "PayloadTooLarge")


async def test_request_guard_counts_an_unannounced_body_across_messages() -> None:
    """Without ``Content-Length`` the body is counted as the app reads it, over all its messages:
    two 60-byte parts are over a 100-byte limit although each is under it."""
    app, seen = _echo_app()
    part = b" " * 60
    assert await _call(app, chunks=[part, part + b"{}"]) == (413, TOO_LARGE)
    assert seen == []
    assert await _call(app, chunks=[b" " * 49, b" " * 49 + b"{}"]) == (200, {})  # exactly 100 bytes


async def test_request_guard_lets_other_scopes_through_untouched() -> None:
    """WebSocket (and lifespan) scopes are not HTTP requests: the app gets them as they came."""
    calls: list[tuple[Scope, Receive, Send]] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append((scope, receive, send))

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        raise AssertionError(f"the guard answered {message}")

    scope = {"type": "websocket", "path": "/x\x00", "query_string": b"a=%00", "headers": []}
    await RequestGuard(inner, max_body=LIMIT)(scope, receive, send)
    assert calls == [(scope, receive, send)]


@pytest.mark.parametrize("body,expected", [
    (b"", (200, {})),
    (b" \n\t", (200, {})),
    (b'{"hostname": "pds.example.com", "n": [1, {"k": null}]}',
     (200, {"hostname": "pds.example.com", "n": [1, {"k": None}]})),
    (b"{", (400, {"error": "InvalidRequest", "message": "request body is not JSON"})),
    (b"[" * 50_000 + b"]" * 50_000, (400, {"error": "InvalidRequest", "message": "request body is not JSON"})),
    (b"[1]", (400, {"error": "InvalidRequest", "message": "request body must be a JSON object"})),
    (b'"text"', (400, {"error": "InvalidRequest", "message": "request body must be a JSON object"})),
    (b'{"a": ["b\\u0000"]}', (400, NUL)),
    (b'{"a\\u0000": 1}', (400, NUL)),
])
async def test_json_object(body: bytes, expected: tuple[int, Any]) -> None:
    app, _ = _echo_app(max_body=200_000)
    assert await _call(app, chunks=[body]) == expected
