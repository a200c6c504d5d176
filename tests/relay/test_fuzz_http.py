"""Fuzzing the whole HTTP surface (XRPC methods from the Lexicons, every admin route) on both
stores: no request may get a 500, and every error is an XRPC error body."""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.routing import Route

from firehose.state import AccountState
from relay.admin import admin_routes
from relay.ssrf import static_resolver
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
