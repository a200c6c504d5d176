"""HTTP limits of the main port, with real sockets on 127.0.0.1 against the server ``relay serve``
builds (``relay.serve.build_server``: uvicorn with ``relay.connection_limits``).

Slow and idle connections are closed by the header timeout while ``/_health`` keeps answering;
the connection and WebSocket caps answer 503 with Retry-After; requestCrawl and failed admin
authentications are limited per client address (429 with Retry-After); the daily new-host limit
holds exactly under 40 concurrent requestCrawls. Timeouts are small (settings), and every wait is
on an event, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from relay.config import RelayConfig
from relay.connection_limits import ConnectionLimits
from relay.gate import ServiceGate
from relay.serve import build_server
from relay.service import RelayService
from tests.relay.e2e import metric_value
from tests.relay.helpers import RunningRelay
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def limited_relay(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[RunningRelay, ConnectionLimits]]:
    """A relay in this process behind the main-port server of ``relay serve``."""
    raw = {"bind": "127.0.0.1:0", "database_url": str(tmp_path / "relay.sqlite"), "validation_workers": 0,
           "allow_insecure_hosts": True, **settings}
    config = RelayConfig.from_values({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in raw.items()})
    service = RelayService(config)
    await service.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, limits = build_server(ServiceGate(service), config, service.metrics.registry)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started, "the server to start", timeout=10)
        yield RunningRelay(service, f"http://127.0.0.1:{sock.getsockname()[1]}"), limits
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
        await service.stop()


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def _health(url: str) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"{url}/_health")
        assert r.status_code == 200


async def test_slowloris_connections_are_closed_by_the_header_timeout(tmp_path: Path) -> None:
    """20 connections send a request's headers a byte at a time (and one does so for its second
    request on a keep-alive connection): each is answered 408 and closed by the header timeout
    while ``/_health`` keeps answering on fresh connections."""
    async with limited_relay(tmp_path, http_header_timeout="1s") as (relay, limits):
        conns = [await _open(relay.url) for _ in range(20)]
        reader, writer = conns[0]  # a keep-alive connection: a whole request first
        writer.write(b"GET /_health HTTP/1.1\r\nhost: relay\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        closed: list[bytes] = []

        async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for byte in b"GET /_health HTTP/1.1\r\nhost: relay\r\nx-slow: " + b"a" * 1000:
                if reader.at_eof():
                    break
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(0.2)  # a header byte now and then, never the end of the headers

        async def watch(reader: asyncio.StreamReader) -> None:
            closed.append(await reader.read())  # everything until the server closes

        dribblers = [asyncio.create_task(dribble(r, w)) for r, w in conns]
        watchers = [asyncio.create_task(watch(r)) for r, _ in conns]
        try:
            await _health(relay.url)  # while they dribble
            await until(lambda: len(closed) == 20, "every slow connection closed", timeout=15)
            await _health(relay.url)
        finally:
            for t in dribblers + watchers:
                t.cancel()
            for _, w in conns:
                w.close()
    assert all(c.startswith(b"HTTP/1.1 408") for c in closed), closed
    assert limits.refused["header_timeout"] == 20


async def test_connection_cap_answers_503_and_frees_up(tmp_path: Path) -> None:
    async with limited_relay(tmp_path, max_connections=5, http_header_timeout="30s") as (relay, limits):
        idle = [await _open(relay.url) for _ in range(5)]
        await until(lambda: len(limits.connections) == 5, "five open connections")
        reader, writer = await _open(relay.url)
        answer = await asyncio.wait_for(reader.read(), 5)  # answered and closed before being read
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in answer.lower()
        assert b"TooManyConnections" in answer
        idle.pop()[1].close()
        await until(lambda: len(limits.connections) == 4, "one connection gone")
        await _health(relay.url)
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{relay.url}/metrics")).text
        for _, w in idle:
            w.close()
    assert limits.refused["too_many_connections"] == 1
    assert metric_value(text, "relay_http_refused_total", reason="too_many_connections") == 1


async def test_websocket_cap_answers_503_while_http_still_answers(tmp_path: Path) -> None:
    async with limited_relay(tmp_path, max_websockets=2) as (relay, limits):
        async with connect(relay.ws_url) as one, connect(relay.ws_url):
            await until(lambda: limits.websockets == 2, "two websockets")
            with pytest.raises(InvalidStatus) as refused:
                async with connect(relay.ws_url):
                    pass
            response = refused.value.response
            assert response.status_code == 503 and response.headers["retry-after"] == "5"
            await _health(relay.url)
            await one.close()
            await until(lambda: limits.websockets == 1, "one websocket gone")
            async with connect(relay.ws_url):
                pass
    assert limits.refused["too_many_websockets"] == 1 and limits.websockets == 0


async def test_request_crawl_is_rate_limited_per_client(tmp_path: Path) -> None:
    async with limited_relay(tmp_path, crawl_requests_per_minute=3) as (relay, _):
        async with httpx.AsyncClient(base_url=relay.url) as http:
            crawl = "/xrpc/com.atproto.sync.requestCrawl"
            for _ in range(3):  # refused for their hostname, but they count
                r = await http.post(crawl, json={"hostname": "not a host"})
                assert r.status_code == 400
            r = await http.post(crawl, json={"hostname": "not a host"})
            assert r.status_code == 429 and r.json()["error"] == "RateLimitExceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 20  # a token comes back every 20 s
            other = await http.post(crawl, json={"hostname": "not a host"}, headers={"x-forwarded-for": "192.0.2.7"})
            assert other.status_code == 400  # another client address has its own budget
            text = (await http.get("/metrics")).text
    assert metric_value(text, "relay_crawl_requests_total", result="rate_limited") == 1


async def test_failed_admin_authentication_is_rate_limited_per_client(tmp_path: Path) -> None:
    async with limited_relay(tmp_path, admin_token="secret", admin_auth_failures_per_minute=3) as (relay, _):
        async with httpx.AsyncClient(base_url=relay.url) as http:
            wrong = {"authorization": "Bearer guess"}
            right = {"authorization": "Bearer secret"}
            assert (await http.get("/admin/hosts", headers=right)).status_code == 200
            for _ in range(2):
                assert (await http.get("/admin/hosts", headers=wrong)).status_code == 403
            # the dashboard checks the same token: its failures count too
            assert (await http.get("/dashboard/data", headers=wrong)).status_code == 403
            r = await http.get("/admin/hosts", headers=wrong)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            # the right token from the same address is refused as well: guessing gains nothing
            assert (await http.get("/admin/hosts", headers=right)).status_code == 429
            assert (await http.get("/dashboard/data", headers=right)).status_code == 429
            assert (await http.get("/dashboard/data")).status_code == 200  # the public view stays
            elsewhere = await http.get("/admin/hosts", headers={**right, "x-forwarded-for": "192.0.2.8"})
            assert elsewhere.status_code == 200
            text = (await http.get("/metrics")).text
    assert metric_value(text, "relay_admin_requests_total", result="rate_limited") == 3


class DescribeServers:
    """``n`` hosts on 127.0.0.1 (one port each) answering ``describeServer`` after ``delay``
    seconds — 200 with a DID, or 404 for the ``failing`` ones — and nothing else."""

    def __init__(self, n: int, *, failing: int = 0, delay: float = 0.2) -> None:
        self.n, self.failing, self.delay = n, failing, delay
        self.servers: list[asyncio.Server] = []
        self.good: list[str] = []
        self.bad: list[str] = []

    async def __aenter__(self) -> DescribeServers:
        for i in range(self.n + self.failing):
            ok = i < self.n

            async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ok: bool = ok) -> None:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    await asyncio.sleep(self.delay)
                    if ok and b"describeServer" in head.split(b"\r\n", 1)[0]:
                        body = b'{"did": "did:web:pds.test"}'
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                     + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
                    else:
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    await writer.drain()
                except (ConnectionError, asyncio.IncompleteReadError):
                    pass
                finally:
                    writer.close()

            server = await asyncio.start_server(answer, "127.0.0.1", 0)
            self.servers.append(server)
            (self.good if ok else self.bad).append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            server.close()


async def test_the_daily_new_host_limit_is_exact_under_concurrency(tmp_path: Path) -> None:
    """With a limit of 10 new hosts a day: 10 requestCrawls for hosts whose probe fails, all at
    once, each give their place back; then 40 for distinct valid hosts, all at once: exactly 10
    are admitted, the other 30 are refused ``new_host_limit``."""
    async with DescribeServers(40, failing=10) as hosts:
        async with limited_relay(tmp_path, new_hosts_per_day=10, crawl_requests_per_minute=0) as (relay, _):
            async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
                async def crawl(hostname: str) -> httpx.Response:
                    return await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})

                bad = await asyncio.gather(*(crawl(h) for h in hosts.bad))
                good = await asyncio.gather(*(crawl(h) for h in hosts.good))
            stored = await relay.service.store.list_hosts(limit=100)
    assert all(r.status_code == 400 and "describe_server_failed" in r.json()["message"] for r in bad)
    admitted = [r for r in good if r.status_code == 200]
    refused = [r for r in good if r.status_code != 200]
    assert len(admitted) == 10, [r.text for r in good]
    assert all(r.status_code == 400 and "new_host_limit" in r.json()["message"] for r in refused)
    assert len(stored) == 10


async def test_relay_serve_applies_the_limits(tmp_path: Path) -> None:
    """``relay serve`` as a process: its main port closes a slowloris connection (408) and counts
    it in ``/metrics`` — the limits are wired into the server the command runs."""
    from tests.faults.harness import RelayProcess

    settings = {"RELAY_DATABASE_URL": str(tmp_path / "relay.sqlite"), "RELAY_VALIDATION_WORKERS": "0",
                "RELAY_HTTP_HEADER_TIMEOUT": "1s"}
    async with RelayProcess("serve", settings, tmp_path / "relay.log") as relay:
        await relay.start(timeout=60)
        reader, writer = await _open(relay.url)
        writer.write(b"GET /_health HTTP/1.1\r\nhost: relay\r\nx-slow: a")  # and never the rest
        answer = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{relay.url}/metrics")).text
    assert answer.startswith(b"HTTP/1.1 408")
    assert metric_value(text, "relay_http_refused_total", reason="header_timeout") == 1
