"""Sibling relays (``relay.siblings``): two real relays that list each other, a requestCrawl and
every forwarded admin change made on A reach B once and stop there; forwarding is retried,
bounded, counted and never holds up the change on A; relays name themselves (``Server``) and are
not subscribed as PDSes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from websockets.asyncio.client import connect

from relay.config import ConfigError, RelayConfig
from relay.metrics import RelayMetrics
from relay.service import RelayService
from relay.siblings import VIA, Change, SiblingForwarder, carries_our_via, is_relay_server
from sim import SimConfig, SimFleet
from tests.relay.e2e import crawl, metric_value
from tests.relay.helpers import RunningRelay, bound_socket, running_relay, serve_asgi
from tests.waiting import until, until_async

TOKEN = "sibling-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def sibling_pair(tmp_path: Path, plc_url: str) -> AsyncIterator[tuple[RunningRelay, RunningRelay]]:
    """Relays A and B, each listing the other in ``RELAY_SIBLING_RELAYS`` (their ports are bound
    first, so each knows the other's URL before it starts)."""
    socks = [bound_socket(), bound_socket()]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    async with contextlib.AsyncExitStack() as stack:
        relays = []
        for i, sock in enumerate(socks):
            config = RelayConfig.from_values({
                "database_url": str(tmp_path / f"relay{i}.sqlite"), "bind": "127.0.0.1:0",
                "allow_insecure_hosts": "true", "plc_url": plc_url, "validation_workers": "0",
                "admin_token": TOKEN, "sibling_relays": urls[1 - i]})
            service = RelayService(config)
            await service.start()
            stack.push_async_callback(service.stop)
            url = await stack.enter_async_context(serve_asgi(service.build_app(), sock=sock))
            relays.append(RunningRelay(service, url))
        yield relays[0], relays[1]


async def _metrics(relay: RunningRelay) -> str:
    async with httpx.AsyncClient(base_url=relay.url) as http:
        return (await http.get("/metrics")).text


async def _audit(relay: RunningRelay) -> list[tuple[str, str, str]]:
    """The relay's admin actions, as its audit trail lists them (action, target, detail)."""
    async with httpx.AsyncClient(base_url=relay.url, headers=AUTH) as http:
        actions = (await http.get("/admin/audit")).json()["actions"]
    return [(a["action"], a["target"], a["detail"]) for a in actions]


async def test_a_crawl_and_admin_changes_on_a_reach_sibling_b_and_stop_there(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=2903))
    await fleet.start()
    try:
        async with sibling_pair(tmp_path, fleet.plc_url) as (a, b):
            hostname = fleet.hosts[0].hostname
            did = fleet.accounts[0].did
            await crawl(a.url, hostname)  # B is told to crawl it too
            await until_async(lambda: _known(b, hostname), "B to crawl the host A was asked to crawl")
            await fleet.generate(4)
            for relay in (a, b):
                await until_async(lambda relay=relay: _has_account(relay, did), "both relays to follow the account")

            changes = [("POST", f"/admin/hosts/{hostname}/limits", {"account_limit": 7, "rate_limit_per_second": 40}),
                       ("POST", f"/admin/accounts/{did}/takedown", None),
                       ("POST", f"/admin/accounts/{did}/reverse-takedown", None),
                       ("POST", "/admin/domain-bans", {"domain": "banned.example"}),
                       ("DELETE", "/admin/domain-bans/banned.example", None),
                       ("POST", f"/admin/hosts/{hostname}/block", None),
                       ("POST", f"/admin/hosts/{hostname}/unblock", None)]
            async with httpx.AsyncClient(base_url=a.url, headers=AUTH) as http:
                for method, path, body in changes:
                    r = await http.request(method, path, json=body)
                    assert r.status_code == 200, (path, r.text)
                    assert r.headers["server"] == "atproto-relay"
                # not forwarded: reads, and a change that is not one of the forwarded kinds
                assert (await http.get("/admin/hosts")).status_code == 200
                r = await http.post(f"/admin/hosts/{hostname}/validation", json={"lenient": True})
                assert r.status_code == 200

            sent = len(changes) + 1  # the requestCrawl too
            await until_async(lambda: _received(b, sent), f"B to receive the {sent} changes from A")
            text = await _metrics(a)
            assert metric_value(text, "relay_sibling_forwards_total", sibling=b.url, result="forwarded") == sent
            assert f'relay_sibling_forwards_total{{result="dropped",sibling="{b.url}"}} 0.0' in text  # from the start
            assert metric_value(text, "relay_sibling_received_total") == 0  # nothing came back
            # B applied each change as A did, in A's order (a forwarded change is not logged as anything else)
            ours, theirs = await _audit(a), await _audit(b)
            assert [x for x in ours if x[0] != "set_validation"] == theirs
            b_host = await b.service.store.get_host(hostname)
            assert b_host is not None and b_host.account_limit == 7 and b_host.rate_limit_per_second == 40
            assert b_host.status == "active" and b_host.lenient is None  # unblocked; validation not forwarded
            state = await b.service.store.get_account(did)
            assert state is not None and state.local_status == "active"
            assert "banned.example" not in await b.service.store.list_domain_bans()
            # B passed nothing on (A is its sibling too): nothing sent, nothing queued
            text = await _metrics(b)
            assert metric_value(text, "relay_sibling_forwards_total") == 0
            assert b.service.siblings is not None and b.service.siblings.queued(a.url) == 0
    finally:
        await fleet.stop()


async def _known(relay: RunningRelay, hostname: str) -> bool:
    return await relay.service.store.get_host(hostname) is not None


async def _has_account(relay: RunningRelay, did: str) -> bool:
    return await relay.service.store.get_account(did) is not None


async def _received(relay: RunningRelay, n: int) -> bool:
    return metric_value(await _metrics(relay), "relay_sibling_received_total") >= n


class FakeSibling:
    """A sibling relay's admin endpoint on a real port: records each request, answers from
    ``answers`` (then 200), and may hold every answer until ``release`` is set."""

    def __init__(self, answers: list[int] | None = None, *, hold: bool = False) -> None:
        self.answers = list(answers or [])
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.app = Starlette(routes=[Route("/{path:path}", self._answer, methods=["GET", "POST", "DELETE"])])

    async def _answer(self, request: Request) -> Response:
        self.requests.append((request.method, request.url.path, dict(request.headers), await request.body()))
        await self.release.wait()
        status = self.answers.pop(0) if self.answers else 200
        return JSONResponse({}, status_code=status, headers={"retry-after": "0"} if status == 429 else None)


def _change(path: str = "/admin/hosts/h.example/block", body: bytes = b"") -> Change:
    return Change("POST", path, body, f"Bearer {TOKEN}", "application/json" if body else None)


def _count(metrics: RelayMetrics, url: str, result: str) -> float:
    return metrics.registry.get_sample_value("relay_sibling_forwards_total", {"sibling": url, "result": result}) or 0.0


def _queued_bytes(metrics: RelayMetrics, url: str) -> float | None:
    return metrics.registry.get_sample_value("relay_sibling_queue_bytes", {"sibling": url})


async def test_failures_are_retried_with_backoff_then_given_up_and_refusals_are_not_retried() -> None:
    flaky, refusing, down = FakeSibling([503, 429, 200]), FakeSibling([403]), FakeSibling([502] * 10)
    async with serve_asgi(flaky.app) as flaky_url, serve_asgi(refusing.app) as refusing_url, \
            serve_asgi(down.app) as down_url:
        metrics = RelayMetrics()
        forwarder = SiblingForwarder([flaky_url, refusing_url, down_url], metrics=metrics, attempts=3,
                                     retry_base=0.001, retry_max=0.01)
        forwarder.start()
        try:
            for sibling in forwarder.siblings:
                assert forwarder.enqueue(sibling, _change(body=b'{"x": 1}'))
            await until(lambda: sum(forwarder.queued(u) for u in (flaky_url, refusing_url, down_url)) == 0,
                        "every sibling's queue to drain")
        finally:
            await forwarder.close()
    assert len(flaky.requests) == 3 and len(refusing.requests) == 1 and len(down.requests) == 3
    for method, path, headers, body in flaky.requests + refusing.requests + down.requests:
        assert (method, path, body) == ("POST", "/admin/hosts/h.example/block", b'{"x": 1}')
        assert headers["via"] == VIA and headers["authorization"] == f"Bearer {TOKEN}"
    assert (_count(metrics, flaky_url, "retried"), _count(metrics, flaky_url, "forwarded")) == (2, 1)
    assert (_count(metrics, refusing_url, "rejected"), _count(metrics, refusing_url, "retried")) == (1, 0)
    assert (_count(metrics, down_url, "retried"), _count(metrics, down_url, "failed")) == (2, 1)
    assert _count(metrics, down_url, "forwarded") == 0


async def test_the_queue_is_bounded_in_items_and_in_bytes() -> None:
    held = FakeSibling(hold=True)
    async with serve_asgi(held.app) as url:
        metrics = RelayMetrics()
        size = _change().size
        forwarder = SiblingForwarder([url], metrics=metrics, max_items=3, max_bytes=10 * size)
        forwarder.start()
        sibling = forwarder.siblings[0]
        try:
            assert forwarder.enqueue(sibling, _change())
            await until(lambda: len(held.requests) == 1, "the head to be in flight")
            assert forwarder.enqueue(sibling, _change()) and forwarder.enqueue(sibling, _change())
            assert not forwarder.enqueue(sibling, _change())  # 3 items queued (the head in flight among them)
            assert _count(metrics, url, "dropped") == 1
            assert _queued_bytes(metrics, url) == 3 * size
            held.release.set()
            await until(lambda: forwarder.queued(url) == 0, "the queue to drain")
            big = _change(body=b"x" * (10 * size))  # over the byte bound on its own
            assert not forwarder.enqueue(sibling, big)
            assert _count(metrics, url, "dropped") == 2
            assert forwarder.enqueue(sibling, _change(body=b"x" * (8 * size)))  # under it
            await until(lambda: forwarder.queued(url) == 0, "the queue to drain")
        finally:
            await forwarder.close()
    assert _count(metrics, url, "forwarded") == 4 and len(held.requests) == 4
    assert _queued_bytes(metrics, url) == 0


async def test_a_sibling_that_does_not_answer_never_holds_up_the_change_here(tmp_path: Path) -> None:
    """The sibling holds its answer until the test has A's answer: were A to wait for the
    sibling, the admin call would time out."""
    held = FakeSibling(hold=True)
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=2904))
    await fleet.start()
    try:
        async with serve_asgi(held.app) as sibling_url:
            config = RelayConfig.from_values({
                "database_url": str(tmp_path / "a.sqlite"), "bind": "127.0.0.1:0", "allow_insecure_hosts": "true",
                "plc_url": fleet.plc_url, "validation_workers": "0", "admin_token": TOKEN,
                "sibling_relays": sibling_url + "/"})
            service = RelayService(config)
            await service.start()
            try:
                async with serve_asgi(service.build_app()) as url, \
                        httpx.AsyncClient(base_url=url, headers=AUTH, timeout=5) as http:
                    hostname = fleet.hosts[0].hostname
                    await crawl(url, hostname)  # public: without a token
                    r = await http.post(f"/admin/hosts/{hostname}/limits", json={"account_limit": 3})
                    assert r.status_code == 200 and r.json()["accountLimit"] == 3
                    await until(lambda: len(held.requests) == 1, "the sibling to be asked")
                    assert service.siblings is not None and service.siblings.queued(sibling_url) == 2
                    held.release.set()
                    await until(lambda: service.siblings is not None and service.siblings.queued(sibling_url) == 0,
                                "the queue to drain")
            finally:
                await service.stop()
    finally:
        await fleet.stop()
    assert [(m, p) for m, p, _, _ in held.requests] == [
        ("POST", "/xrpc/com.atproto.sync.requestCrawl"), ("POST", f"/admin/hosts/{hostname}/limits")]
    assert "authorization" not in held.requests[0][2]  # requestCrawl is public: no token to pass on
    assert held.requests[1][2]["authorization"] == f"Bearer {TOKEN}" and json.loads(held.requests[1][3]) == {"account_limit": 3}


async def test_a_relay_is_not_subscribed_as_a_pds_only_as_a_relay_upstream(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=2905))
    await fleet.start()
    try:
        async with sibling_pair(tmp_path, fleet.plc_url) as (a, b), \
                httpx.AsyncClient(base_url=a.url, headers=AUTH) as http:
            b_host = b.url.removeprefix("http://")
            for r in (await http.get("/xrpc/com.atproto.sync.listHosts"), await http.get("/no/such/page"),
                      await http.get("/_health")):
                assert r.headers.get_list("server") == ["atproto-relay"], r.headers
            for path in ("/xrpc/com.atproto.sync.subscribeRepos", "/subscribe"):  # the WebSocket handshakes too
                async with connect(a.url.replace("http://", "ws://") + path) as ws:
                    assert ws.response is not None and ws.response.headers.get_all("server") == ["atproto-relay"]
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": b_host})
            assert r.status_code == 400 and "host_is_relay" in r.json()["message"], r.text
            r = await http.post("/admin/hosts", json={"hostname": b_host})  # an operator adding it as a PDS: no
            assert r.status_code == 400 and "host_is_relay" in r.json()["message"], r.text
            assert await a.service.store.get_host(b_host) is None
            assert metric_value(await _metrics(a), "relay_crawl_requests_total", result="host_is_relay") == 1
            r = await http.post("/admin/hosts", json={"hostname": b_host, "relay": True})
            assert r.status_code == 200 and r.json()["relay"] is True, r.text
    finally:
        await fleet.stop()


async def test_the_plain_websockets_listener_names_the_relay_too(tmp_path: Path) -> None:
    async with running_relay(database_url=str(tmp_path / "relay.sqlite"), firehose_bind="127.0.0.1:0") as relay:
        assert relay.service.firehose_url is not None
        async with connect(relay.service.firehose_url + "/xrpc/com.atproto.sync.subscribeRepos") as ws:
            assert ws.response is not None and ws.response.headers.get_all("server") == ["atproto-relay"]


def test_via_and_server_header_parsing() -> None:
    assert carries_our_via({"via": "1.1 atproto-relay"})
    assert carries_our_via({"via": "1.1 google, 1.1 ATPROTO-RELAY (sibling)"})
    assert not carries_our_via({"via": "1.1 google"}) and not carries_our_via({})
    assert not carries_our_via({"via": "atproto-relay"})  # no protocol: not a Via entry of ours
    assert is_relay_server({"server": "atproto-relay"}) and is_relay_server({"server": "atproto-relay/0.3 (go)"})
    assert not is_relay_server({"server": "uvicorn"}) and not is_relay_server({})
    assert not is_relay_server({"server": "atproto-relayish"})


@pytest.mark.parametrize("value", ["relay2.example.com", "ftp://relay2.example.com", "https://", "https://a b"])
def test_sibling_urls_are_checked(value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        RelayConfig.from_env({"RELAY_SIBLING_RELAYS": value})
    assert exc.value.reason == "bad_sibling_relays"


def test_sibling_urls_parse() -> None:
    config = RelayConfig.from_env({"RELAY_SIBLING_RELAYS": "https://a.example, http://10.0.0.2:2470/"})
    assert config.sibling_relays == ("https://a.example", "http://10.0.0.2:2470/")
