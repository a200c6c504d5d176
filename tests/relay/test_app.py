"""The relay's HTTP surface over real sockets: XRPC endpoints, errors, requestCrawl, admin API."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.asyncio.client import connect

from firehose.state import AccountState
from relay.ssrf import static_resolver
from tests.relay.helpers import serve_asgi
from tests.waiting import until

DID_A = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"
DID_B = "did:plc:bbbbbbbbbbbbbbbbbbbbbbbb"
CID = "bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm"


def _fake_pds() -> Starlette:
    async def describe(request):  # type: ignore[no-untyped-def]
        return JSONResponse({"did": "did:web:pds.test", "availableUserDomains": []})

    return Starlette(routes=[Route("/xrpc/com.atproto.server.describeServer", describe)])


async def test_xrpc_endpoints(relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    async with relay_factory(database_url=database_url, plc_url="http://127.0.0.1:9") as relay:
        store = relay.service.store
        await store.upsert_account(AccountState(did=DID_A, host="pds.example.com", rev="3lmxjza3nva27",
                                                commit_cid=CID, data_cid=CID))
        await store.upsert_account(AccountState(did=DID_B, host="pds.example.com", rev="3lmxjza3nva28",
                                                commit_cid=CID, data_cid=CID, local_status="takendown"))
        async with httpx.AsyncClient(base_url=relay.url + "/xrpc/") as http:
            r = await http.get("com.atproto.sync.listHosts")
            assert r.status_code == 200
            assert r.json() == {"hosts": [{"hostname": "pds.example.com", "seq": 0, "accountCount": 2,
                                           "status": "active"}]}
            r = await http.get("com.atproto.sync.getHostStatus", params={"hostname": "nope.example.com"})
            assert r.status_code == 400 and r.json()["error"] == "HostNotFound"
            r = await http.get("com.atproto.sync.getRepoStatus", params={"did": DID_A})
            assert r.json() == {"did": DID_A, "active": True, "rev": "3lmxjza3nva27"}
            r = await http.get("com.atproto.sync.getRepoStatus", params={"did": DID_B})
            assert r.json() == {"did": DID_B, "active": False, "status": "takendown"}
            r = await http.get("com.atproto.sync.getRepoStatus", params={"did": "did:plc:cccccccccccccccccccccccc"})
            assert r.status_code == 400 and r.json()["error"] == "RepoNotFound"
            r = await http.get("com.atproto.sync.getRepoStatus", params={"did": "not-a-did"})
            assert r.status_code == 400 and r.json()["error"] == "InvalidRequest" and r.json()["message"]
            r = await http.get("com.atproto.sync.getRepoStatus")
            assert r.status_code == 400 and r.json()["error"] == "InvalidRequest"
            r = await http.get("com.atproto.sync.listRepos", params={"limit": 1})
            assert r.json() == {"repos": [{"did": DID_A, "head": CID, "rev": "3lmxjza3nva27", "active": True}],
                                "cursor": DID_A}
            r = await http.get("com.atproto.sync.listRepos", params={"cursor": DID_A})
            assert r.json()["repos"][0]["status"] == "takendown" and "cursor" not in r.json()
            r = await http.get("com.atproto.sync.listRepos", params={"limit": 5000})
            assert r.status_code == 400
            r = await http.get("com.atproto.sync.getLatestCommit", params={"did": DID_A})
            assert r.json() == {"cid": CID, "rev": "3lmxjza3nva27"}
            r = await http.get("com.atproto.sync.getLatestCommit", params={"did": DID_B})
            assert r.status_code == 400 and r.json()["error"] == "RepoTakendown"
            r = await http.get("com.atproto.sync.getRepo", params={"did": DID_B})
            assert r.json()["error"] == "RepoTakendown"
            r = await http.get("com.atproto.sync.getRepo", params={"did": DID_A, "since": "3lmxjza3nva20"})
            assert r.status_code == 302
            assert r.headers["location"] == ("https://pds.example.com/xrpc/com.atproto.sync.getRepo?"
                                             "did=did%3Aplc%3Aaaaaaaaaaaaaaaaaaaaaaaaa&since=3lmxjza3nva20")
            r = await http.get("com.atproto.sync.getBlob")
            assert r.status_code == 501 and r.json()["error"] == "MethodNotImplemented"
            r = await http.get("com.atproto.sync.subscribeRepos")
            assert r.status_code == 426
        async with httpx.AsyncClient(base_url=relay.url) as http:
            health = (await http.get("/_health")).json()
            assert health["status"] == "ok" and health["seq"] == 0
            ready = await http.get("/_ready")
            assert ready.status_code == 200 and ready.json()["status"] == "ready"
            assert ready.json()["sequencer"] == "running"
            metrics = (await http.get("/metrics")).text
            assert "relay_current_seq" in metrics and "relay_consumers" in metrics


@pytest.mark.parametrize("hostname", ["localhost", "10.0.0.1", "169.254.169.254", "evil.example.com",
                                      "localhost:2583", "http://pds.example.com"])
async def test_request_crawl_refuses_non_public(relay_factory, hostname: str) -> None:  # type: ignore[no-untyped-def]
    resolver = static_resolver({"evil.example.com": ["127.0.0.1"]})
    async with relay_factory(resolver=resolver) as relay, httpx.AsyncClient(base_url=relay.url) as http:
        r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "InvalidRequest"
        assert await relay.service.store.list_hosts() == []
        text = (await http.get("/metrics")).text
        assert "relay_crawl_requests_total{result=" in text
        from mst import native

        assert f"relay_mst_compiled {1.0 if native.active() else 0.0}" in text


async def test_request_crawl_insecure_mode_and_bans(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with serve_asgi(_fake_pds()) as pds_url, relay_factory(allow_insecure_hosts=True,
                                                                  admin_token="tok") as relay:
        hostname = pds_url.removeprefix("http://")
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})
            assert r.status_code == 200, r.text
            r = await http.get("/xrpc/com.atproto.sync.getHostStatus", params={"hostname": hostname})
            assert r.json()["hostname"] == hostname and r.json()["status"] in ("active", "offline", "idle")
            hosts = (await http.get("/xrpc/com.atproto.sync.listHosts")).json()["hosts"]
            assert [h["hostname"] for h in hosts] == [hostname]
            auth = {"authorization": "Bearer tok"}
            r = await http.post(f"/admin/hosts/{hostname}/block", headers=auth)
            assert r.json()["status"] == "banned"
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})
            assert r.status_code == 400 and r.json()["error"] == "HostBanned"
            r = await http.post("/admin/domain-bans", headers=auth, json={"domain": "example.com"})
            assert r.status_code == 200
            assert (await http.get("/admin/domain-bans", headers=auth)).json() == {"domains": ["example.com"]}
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": "pds.sub.example.com"})
            assert r.json()["error"] == "HostBanned"
            r = await http.post(f"/admin/hosts/{hostname}/unblock", headers=auth)
            assert r.json()["status"] == "active"
            r = await http.post(f"/admin/hosts/{hostname}/limits", headers=auth, json={"account_limit": 7})
            assert r.json()["accountLimit"] == 7
            r = await http.post(f"/admin/hosts/{hostname}/limits", headers=auth,
                                json={"rate_limit_per_second": 20, "rate_limit_per_day": 1000})
            assert r.json()["rateLimits"] == {"perSecond": 20, "perHour": None, "perDay": 1000}
            host = await relay.service.store.get_host(hostname)
            limits = relay.service.upstreams.subscriber_config(host).rate_limits
            assert limits == []  # loopback in insecure mode: never rate-limited
            from backfill.types import HostState

            remote = HostState(hostname="pds.example.com", rate_limit_per_second=20)
            assert relay.service.upstreams.subscriber_config(remote).rate_limits[0] == (20.0, 1.0)
            remote.trusted = True
            assert relay.service.upstreams.subscriber_config(remote).rate_limits == []
            r = await http.post(f"/admin/hosts/{hostname}/limits", headers=auth, json={"rate_limit_per_second": -1})
            assert r.status_code == 400
            r = await http.post("/admin/crawling", headers=auth, json={"enabled": False})
            assert r.json() == {"enabled": False, "source": "admin"}
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": "other.test:1"})
            assert r.status_code == 400 and "crawling_disabled" in r.json()["message"]


@pytest.mark.parametrize("configured,header,result", [
    ("", "Bearer s3cret", "disabled"), ("s3cret", None, "missing"), ("s3cret", "", "missing"),
    ("s3cret", "Basic s3cret", "missing"), ("s3cret", "Bearer", "missing"), ("s3cret", "Bearer ", "missing"),
    ("s3cret", "Bearer s3cret", "ok"), ("s3cret", "bearer s3cret", "ok"), ("s3cret", "Bearer  s3cret ", "ok"),
    ("s3cret", "Bearer s3cre", "wrong"), ("s3cret", "Bearer s3cret s3cret", "wrong"),
])
def test_check_token(configured: str, header: str | None, result: str) -> None:
    """The scheme is the text before the first space (any case); the token, the rest, stripped."""
    from relay.admin import check_token

    assert check_token(configured, header) == result


async def test_admin_requires_token(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """Every admin request is authorized first, answered with an XRPC error naming what is wrong,
    and counted under its result (``relay_admin_requests_total{result}``)."""
    disabled = {"error": "AdminDisabled", "message": "the admin API is off (set RELAY_ADMIN_TOKEN)"}
    missing = {"error": "AuthRequired", "message": "Authorization: Bearer <RELAY_ADMIN_TOKEN> required"}
    wrong = {"error": "InvalidToken", "message": "wrong admin token"}
    async with relay_factory() as relay, httpx.AsyncClient(base_url=relay.url) as http:
        r = await http.get("/admin/hosts", headers={"authorization": "Bearer anything"})
        assert (r.status_code, r.json()) == (404, disabled)
        assert _admin_count(relay, "disabled") == 1
    async with relay_factory(admin_token="s3cret") as relay, httpx.AsyncClient(base_url=relay.url) as http:
        for path in ("/admin/hosts", "/admin/consumers", "/admin/domain-bans"):
            r = await http.get(path)
            assert (r.status_code, r.json()) == (401, missing)
            r = await http.get(path, headers={"authorization": "Bearer s3cre"})
            assert (r.status_code, r.json()) == (403, wrong)
            r = await http.get(path, headers={"authorization": "Basic s3cret"})
            assert (r.status_code, r.json()) == (401, missing)
            r = await http.get(path, headers={"authorization": "Bearer s3cret"})
            assert r.status_code == 200
        r = await http.post(f"/admin/accounts/{DID_A}/takedown")
        assert r.status_code == 401
        assert await relay.service.store.get_account(DID_A) is None
        counts = {result: _admin_count(relay, result) for result in ("ok", "missing", "wrong", "disabled")}
        assert counts == {"ok": 3, "missing": 7, "wrong": 3, "disabled": 0}


def _admin_count(relay, result: str) -> float:  # type: ignore[no-untyped-def]
    return relay.service.metrics.admin_requests.labels(result=result)._value.get()  # type: ignore[no-any-return]


async def test_takedown_emits_account_events(relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    async with relay_factory(database_url=database_url, admin_token="tok") as relay:
        auth = {"authorization": "Bearer tok"}
        async with connect(relay.ws_url + "?cursor=0") as ws, httpx.AsyncClient(base_url=relay.url) as http:
            await until(lambda: len(relay.service.consumers) == 1, "the consumer registered")
            consumers = (await http.get("/admin/consumers", headers=auth)).json()["consumers"]
            assert len(consumers) == 1 and consumers[0]["cursor"] == "0"
            r = await http.post(f"/admin/accounts/{DID_A}/takedown", headers=auth)
            assert r.json()["status"] == "takendown"
            r = await http.post(f"/admin/accounts/{DID_A}/reverse-takedown", headers=auth)
            assert r.json()["status"] == "active"
            frames = [await asyncio.wait_for(ws.recv(), 5) for _ in range(2)]
        bodies = [_decode(frame) for frame in frames]
        assert [b[0]["t"] for b in bodies] == ["#account", "#account"]
        assert bodies[0][1]["active"] is False and bodies[0][1]["status"] == "takendown"
        assert bodies[1][1]["active"] is True and "status" not in bodies[1][1]
        assert bodies[1][1]["seq"] == bodies[0][1]["seq"] + 1
        status = (await _get(relay.url, "com.atproto.sync.getRepoStatus", did=DID_A))
        assert status["active"] is True


async def test_consumer_accounting_counts_batched_frames(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """Through the main port the relay sends replay batches with one write each (firehose.uvicorn_batch);
    the consumer registry and relay_consumer_sent_bytes_total{encoding="cbor"} still count every frame and byte;
    a JSON stream consumer's bytes are the JSON it was sent, counted under encoding="json"."""
    async with relay_factory(admin_token="tok") as relay, httpx.AsyncClient(base_url=relay.url) as http:
        auth = {"authorization": "Bearer tok"}
        for _ in range(6):  # 12 #account events in the store
            await http.post(f"/admin/accounts/{DID_A}/takedown", headers=auth)
            await http.post(f"/admin/accounts/{DID_A}/reverse-takedown", headers=auth)
        async with connect(relay.ws_url + "?cursor=0") as ws:
            frames = [await asyncio.wait_for(ws.recv(), 5) for _ in range(12)]
            assert [_decode(f)[1]["seq"] for f in frames] == list(range(1, 13))
            consumers = (await http.get("/admin/consumers", headers=auth)).json()["consumers"]
        assert len(consumers) == 1
        assert (consumers[0]["framesSent"], consumers[0]["bytesSent"]) == (12, sum(map(len, frames)))
        text = (await http.get("/metrics")).text
        assert f'relay_consumer_sent_bytes_total{{encoding="cbor"}} {float(sum(map(len, frames)))}' in text
        assert 'relay_consumer_sent_bytes_total{encoding="json"} 0.0' in text
        # the JSON stream's consumers: the JSON text as sent, under its own encoding
        async with connect(relay.url.replace("http://", "ws://") + "/subscribe?cursor=0") as ws:
            messages = [await asyncio.wait_for(ws.recv(), 5) for _ in range(12)]
        assert all(isinstance(m, str) and '"kind":"account"' in m for m in messages), messages[0]
        text = (await http.get("/metrics")).text
        json_bytes = sum(len(m.encode()) for m in messages)
        assert f'relay_consumer_sent_bytes_total{{encoding="json"}} {float(json_bytes)}' in text
        assert f'relay_consumer_sent_bytes_total{{encoding="cbor"}} {float(sum(map(len, frames)))}' in text


async def test_consumer_accounting_counts_live_frames(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """A caught-up consumer on the main port is written by the fan-out itself, past the ASGI
    ``send``; the consumer registry and relay_consumer_sent_bytes_total still count every frame and byte."""
    async with relay_factory(admin_token="tok") as relay, httpx.AsyncClient(base_url=relay.url) as http:
        auth = {"authorization": "Bearer tok"}
        async with connect(relay.ws_url) as ws:  # live only
            await until(lambda: len(relay.service.consumers) == 1, "the consumer registered")
            for _ in range(3):  # 6 live #account events
                await http.post(f"/admin/accounts/{DID_A}/takedown", headers=auth)
                await http.post(f"/admin/accounts/{DID_A}/reverse-takedown", headers=auth)
            frames = [await asyncio.wait_for(ws.recv(), 5) for _ in range(6)]
            consumers = (await http.get("/admin/consumers", headers=auth)).json()["consumers"]
        assert len(consumers) == 1
        assert (consumers[0]["framesSent"], consumers[0]["bytesSent"]) == (6, sum(map(len, frames)))
        text = (await http.get("/metrics")).text
        assert f'relay_consumer_sent_bytes_total{{encoding="cbor"}} {float(sum(map(len, frames)))}' in text


def _decode(frame: bytes) -> tuple[dict, dict]:
    from firehose.frames import decode_frame

    f = decode_frame(frame)
    return {"op": f.op, "t": f.t}, f.body


async def _get(base: str, method: str, **params: str) -> dict:
    async with httpx.AsyncClient(base_url=base) as http:
        return (await http.get(f"/xrpc/{method}", params=params)).json()


async def test_new_hosts_per_day_limit(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with serve_asgi(_fake_pds()) as first, serve_asgi(_fake_pds()) as second:
        async with relay_factory(allow_insecure_hosts=True, new_hosts_per_day=1) as relay:
            async with httpx.AsyncClient(base_url=relay.url) as http:
                r = await http.post("/xrpc/com.atproto.sync.requestCrawl",
                                    json={"hostname": first.removeprefix("http://")})
                assert r.status_code == 200
                r = await http.post("/xrpc/com.atproto.sync.requestCrawl",
                                    json={"hostname": second.removeprefix("http://")})
                assert r.status_code == 400 and "new_host_limit" in r.json()["message"]
                # asking again for a known host is not a new host
                r = await http.post("/xrpc/com.atproto.sync.requestCrawl",
                                    json={"hostname": first.removeprefix("http://")})
                assert r.status_code == 200


async def test_operator_switches_and_audit_survive_restarts(relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    """The crawling switch, the new-hosts-per-day count and the audit trail live in the database."""
    auth = {"authorization": "Bearer tok"}
    crawl = "/xrpc/com.atproto.sync.requestCrawl"
    settings = {"database_url": database_url, "admin_token": "tok", "allow_insecure_hosts": True,
                "new_hosts_per_day": 1}
    async with serve_asgi(_fake_pds()) as first, serve_asgi(_fake_pds()) as second:
        first, second = first.removeprefix("http://"), second.removeprefix("http://")
        async with relay_factory(**settings) as relay, httpx.AsyncClient(base_url=relay.url) as http:
            assert (await http.post(crawl, json={"hostname": first})).status_code == 200
            r = await http.post("/admin/crawling", headers=auth, json={"enabled": False})
            assert r.json() == {"enabled": False, "source": "admin"}
        async with relay_factory(**settings) as relay, httpx.AsyncClient(base_url=relay.url) as http:
            assert (await http.get("/admin/crawling", headers=auth)).json() == {"enabled": False, "source": "admin"}
            r = await http.post(crawl, json={"hostname": second})
            assert r.status_code == 400 and "crawling_disabled" in r.json()["message"]
            await http.post("/admin/crawling", headers=auth, json={"enabled": True})
            r = await http.post(crawl, json={"hostname": second})  # the first admission still counts
            assert r.status_code == 400 and "new_host_limit" in r.json()["message"]
            actions = (await http.get("/admin/audit", headers=auth)).json()["actions"]
            assert [(a["action"], a["detail"]) for a in actions] == [
                ("set_crawling", {"enabled": False}), ("set_crawling", {"enabled": True})]
        # the operator now changes RELAY_CRAWLING: that newer decision wins over the stored toggle
        async with relay_factory(**settings, crawling_enabled=False) as relay:
            assert relay.service.hosts.crawling_enabled is False
            assert relay.service.hosts.crawling_source == "config"
        async with relay_factory(**settings, crawling_enabled=False) as relay:  # unchanged config
            await relay.service.hosts.set_crawling(True)
        async with relay_factory(**settings, crawling_enabled=False) as relay:  # the toggle holds again
            assert relay.service.hosts.crawling_enabled is True
            assert relay.service.hosts.crawling_source == "admin"


async def test_request_crawl_requires_describe_server(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with serve_asgi(Starlette(routes=[])) as not_a_pds, relay_factory(allow_insecure_hosts=True) as relay:
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl",
                                json={"hostname": not_a_pds.removeprefix("http://")})
            assert r.status_code == 400 and "describe_server_failed" in r.json()["message"]
            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", content=b"not json")
            assert r.status_code == 400 and r.json()["error"] == "InvalidRequest"


def test_reported_status_precedence() -> None:
    from relay.accounts import account_event_body, reported_status

    base = AccountState(did=DID_A, rev="3lmxjza3nva27")
    assert reported_status(base) == "active"
    assert reported_status(AccountState(did=DID_A, sync_state="desynchronized")) == "desynchronized"
    assert reported_status(AccountState(did=DID_A, sync_state="resyncing")) == "desynchronized"
    assert reported_status(AccountState(did=DID_A, sync_state="throttled")) == "throttled"
    assert reported_status(AccountState(did=DID_A, upstream_status="deactivated", sync_state="throttled")) == "deactivated"
    taken = AccountState(did=DID_A, upstream_status="suspended", local_status="takendown")
    assert reported_status(taken) == "takendown"
    body = account_event_body(taken)
    assert body["active"] is False and body["status"] == "takendown" and body["time"].endswith("Z")


async def test_unreachable_host_goes_offline(relay_factory) -> None:  # type: ignore[no-untyped-def]
    import socket

    from backfill.types import HostState

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        hostname = f"127.0.0.1:{s.getsockname()[1]}"
    async with relay_factory(allow_insecure_hosts=True) as relay:
        ingest = relay.service.upstreams
        assert ingest is not None
        ingest.backoff_base = 0.02
        await relay.service.store.upsert_host(HostState(hostname=hostname, status="active"))
        await ingest.start_host(await relay.service.store.get_host(hostname))
        for _ in range(600):
            await ingest.watch_hosts(offline_after=3)
            if (await relay.service.store.get_host(hostname)).status == "offline":
                break
            await asyncio.sleep(0.05)
        status = await _get(relay.url, "com.atproto.sync.getHostStatus", hostname=hostname)
        assert status["status"] == "offline"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_spark_repair_outbox_is_drained_into_the_stream(relay_factory, pg_dsn: str, tmp_path,  # type: ignore[no-untyped-def]
                                                              backend: str) -> None:
    """A Spark job queues an #account finding; the running relay applies it in the account's lane
    (single writer) and sequences the event, once."""
    import uuid

    import asyncpg

    from spark.db import connect_db

    schema = f"t_relay_{uuid.uuid4().hex[:12]}"
    database_url = f"{pg_dsn}?schema={schema}" if backend == "postgres" else str(tmp_path / "relay.sqlite")

    def queue_repair() -> None:
        db = connect_db(database_url)
        try:
            db.execute("INSERT INTO spark_repair_outbox (dedupe_key, kind, did, active, status, base_status, "
                       "observed_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", f"#account|{DID_A}|deactivated",
                       "#account", DID_A, False, "deactivated", "active", 1.0, 1.0)
        finally:
            db.close()

    async with relay_factory(database_url=database_url) as relay:
        await relay.service.store.upsert_account(AccountState(did=DID_A, host="pds.example.com"))
        await asyncio.to_thread(queue_repair)
        async with connect(relay.ws_url + "?cursor=0") as ws:
            applied = await relay.service.apply_repairs()
            assert applied is not None and (applied.consumed, applied.deferred) == (1, 0)
            header, body = _decode(await asyncio.wait_for(ws.recv(), 5))
        assert header["t"] == "#account" and body["did"] == DID_A
        assert body["active"] is False and body["status"] == "deactivated"
        stored = await relay.service.store.get_account(DID_A)
        assert stored is not None and stored.upstream_status == "deactivated"
        again = await relay.service.apply_repairs()  # consumed: nothing is emitted twice
        assert again is not None and again.consumed == 0
        assert await relay.service.store.latest_seq() == body["seq"]
        # counted like every other sequenced event, once
        metrics = relay.service.metrics.render().decode()
        assert 'relay_events_sequenced_total{type="#account"} 1.0' in metrics
    if backend == "postgres":
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


async def test_repo_status_desynchronized_while_resync_pending(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """The PLC is unreachable, so the repair cannot finish: the account reports desynchronized
    and the failed attempt is counted, and the account is retried (still pending)."""
    async with relay_factory(plc_url="http://127.0.0.1:9") as relay:
        service = relay.service
        assert service.lanes is not None and service.resync is not None
        service.resync.retry_base = 30.0  # keep it pending for the duration of the test
        state = AccountState(did=DID_A, host="pds.example.com", rev="3lmxjza3nva27", commit_cid=CID, data_cid=CID)
        await service.store.upsert_account(state)
        await service.lanes.mark_for_resync(DID_A, "pds.example.com")
        status = await _get(relay.url, "com.atproto.sync.getRepoStatus", did=DID_A)
        assert status == {"did": DID_A, "active": False, "status": "desynchronized"}
        for _ in range(600):
            text = await _metrics(relay.url)
            if 'relay_resyncs_total{result="identity_resolution_failed"}' in text:
                break
            await asyncio.sleep(0.05)
        assert 'relay_resyncs_total{result="identity_resolution_failed"} 1.0' in text
        assert "relay_resync_queue 1.0" in text
        repos = (await _get(relay.url, "com.atproto.sync.listRepos"))["repos"]
        assert repos == [{"did": DID_A, "head": CID, "rev": "3lmxjza3nva27", "active": False,
                          "status": "desynchronized"}]


async def _metrics(base: str) -> str:
    async with httpx.AsyncClient(base_url=base) as http:
        return (await http.get("/metrics")).text
