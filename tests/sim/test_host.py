"""Simulated hosts over real sockets: stream cursor rules, sync XRPC endpoints, PLC documents."""

from __future__ import annotations

import asyncio

import httpx

from firehose.frames import decode_frame
from mst.verify import verify_repo_car
from sim import SimConfig, SimFleet
from sim.host import LogEntry, StreamLog
from sim.ident import SigningKey
from tests.sim.harness import read_frames


def _seqs(frames: list[bytes]) -> list[int]:
    return [decode_frame(f).body["seq"] for f in frames if decode_frame(f).op == 1 and "seq" in decode_frame(f).body]


async def test_fleet_layout_and_plc_documents() -> None:
    async with SimFleet(SimConfig(hosts=3, accounts_per_host=4, seed=5)) as fleet:
        assert len({h.url for h in fleet.hosts}) == 3
        assert all(h.url.startswith("http://127.0.0.1:") and h.url == f"http://{h.hostname}" for h in fleet.hosts)
        assert len(fleet.accounts) == 12 and len({a.did for a in fleet.accounts}) == 12
        assert {a.key.curve for a in fleet.accounts} == {"k256", "p256"}
        async with httpx.AsyncClient() as http:
            for acct in fleet.accounts:
                doc = (await http.get(f"{fleet.plc_url}/{acct.did}")).json()
                assert doc["id"] == acct.did
                (vm,) = doc["verificationMethod"]
                assert vm["id"] == f"{acct.did}#atproto" and vm["type"] == "Multikey"
                assert "did:key:" + vm["publicKeyMultibase"] == acct.key.did_key()
                (svc,) = doc["service"]
                assert svc == {"id": "#atproto_pds", "type": "AtprotoPersonalDataServer",
                               "serviceEndpoint": acct.host.url}
            assert (await http.get(f"{fleet.plc_url}/did:plc:unknownunknownunknown")).status_code == 404
        # every account was announced: #identity, #account, first #commit
        kinds = [t.kind for t in fleet.ground_truth]
        assert kinds.count("#identity") == kinds.count("#account") == kinds.count("#commit") == 12


async def test_cursor_rules() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=6, log_limit=40)) as fleet:
        host = fleet.hosts[0]
        await fleet.generate(20)
        top = host.published_seq
        assert top == 9 + 20
        frames, _ = await read_frames(host.url, 0)
        assert _seqs(frames) == list(range(1, top + 1))  # cursor 0: whole window
        frames, _ = await read_frames(host.url, 10)
        assert _seqs(frames) == list(range(11, top + 1))  # seq > cursor, as the PDS and Bluesky's relay
        frames, _ = await read_frames(host.url, top, idle=0.3)
        assert frames == []  # the latest seq: nothing yet, then live
        frames, closed = await read_frames(host.url, top + 5)
        first = decode_frame(frames[0])
        assert first.op == -1 and first.body["error"] == "FutureCursor" and closed
        frames, _ = await read_frames(host.url, None, idle=0.3)
        assert frames == []  # no cursor: live only
        await fleet.generate(60)  # the 40-frame window slides
        frames, _ = await read_frames(host.url, 3)
        info = decode_frame(frames[0])
        assert info.t == "#info" and info.body["name"] == "OutdatedCursor"
        seqs = _seqs(frames[1:])
        assert seqs == list(range(seqs[0], host.published_seq + 1)) and seqs[0] > 3


async def test_live_subscribers_get_every_frame_in_order() -> None:
    async with SimFleet(SimConfig(hosts=2, accounts_per_host=5, seed=8)) as fleet:
        import asyncio

        readers = [asyncio.create_task(read_frames(h.url, None, idle=1.0)) for h in fleet.hosts]
        for _ in range(50):
            if all(h.subscriber_count for h in fleet.hosts):
                break
            await asyncio.sleep(0.02)
        truth = await fleet.generate(200)
        results = [await r for r in readers]
        for host, (frames, _) in zip(fleet.hosts, results, strict=True):
            expected = [t.upstream_seq for t in truth if t.host == host.hostname]
            assert _seqs(frames) == expected


async def test_sync_endpoints() -> None:
    async with SimFleet(SimConfig(hosts=2, accounts_per_host=3, seed=9)) as fleet:
        await fleet.generate(30)
        host = fleet.hosts[0]
        acct = next(a for a in fleet.accounts if a.host is host)
        async with httpx.AsyncClient(base_url=host.url) as http:
            r = await http.get("/xrpc/com.atproto.sync.getRepo", params={"did": acct.did})
            assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.ipld.car"
            verified = verify_repo_car(r.content, acct.did, acct.key.did_key())
            assert verified.records == acct.repo.records() and verified.commit.rev == acct.repo.rev
            r = await http.get("/xrpc/com.atproto.sync.getLatestCommit", params={"did": acct.did})
            assert r.json() == {"cid": acct.repo.head.encode(), "rev": acct.repo.rev}
            r = await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})
            assert r.json() == {"did": acct.did, "active": True, "rev": acct.repo.rev}
            pages, cursor = [], None
            while True:
                r = await http.get("/xrpc/com.atproto.sync.listRepos",
                                   params={"limit": 2, **({"cursor": cursor} if cursor else {})})
                body = r.json()
                pages += body["repos"]
                cursor = body.get("cursor")
                if not cursor:
                    break
            assert sorted(p["did"] for p in pages) == sorted(a.did for a in fleet.accounts if a.host is host)
            assert all(p["active"] and p["rev"] and p["head"].startswith("bafy") for p in pages)
            r = await http.get("/xrpc/com.atproto.server.describeServer")
            assert r.status_code == 200 and "did" in r.json()
            r = await http.get("/xrpc/com.atproto.sync.getRepo", params={"did": "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"})
            assert r.status_code == 400 and r.json()["error"] == "RepoNotFound"
            r = await http.get("/xrpc/com.atproto.sync.getRepo")
            assert r.status_code == 400 and r.json()["error"] == "InvalidRequest"
            r = await http.get("/xrpc/com.atproto.sync.noSuchThing")
            assert r.status_code == 404
            fleet.set_status(acct, "takendown")
            r = await http.get("/xrpc/com.atproto.sync.getRepo", params={"did": acct.did})
            assert r.status_code == 400 and r.json()["error"] == "RepoTakendown"
            r = await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})
            assert r.json()["active"] is False and r.json()["status"] == "takendown"


async def test_release_paces_prepared_frames() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=5, seed=10, announce_accounts=False)) as fleet:
        made = fleet.prepare(100)
        assert made == 100 and fleet.pending == 100 and fleet.hosts[0].published_seq == 0
        elapsed = await fleet.release(rate=1000)
        assert fleet.pending == 0 and fleet.hosts[0].published_seq == 100
        assert elapsed > 0.05  # 100 frames at 1000/s cannot all go out at once
        assert all(t.sent_at > 0 for t in fleet.ground_truth)


def test_unknown_fault_kind_is_refused() -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1))
    import pytest

    with pytest.raises(ValueError):
        fleet.hosts[0].set_fault("gremlins", 0.5)
    with pytest.raises(ValueError):
        fleet.hosts[0].set_fault("slow", 1.5)
    assert SigningKey  # imported for type clarity


async def test_plc_resolves_simulated_handles() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=12)) as fleet:
        acct = fleet.accounts[1]
        async with httpx.AsyncClient(base_url=fleet.plc_url) as http:
            r = await http.get("/xrpc/com.atproto.identity.resolveHandle", params={"handle": acct.handle})
            assert r.json() == {"did": acct.did}
            r = await http.get("/xrpc/com.atproto.identity.resolveHandle", params={"handle": "nobody.sim.test"})
            assert r.status_code == 400


async def test_plc_keeps_connections_alive_and_refuses_bad_requests() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=13)) as fleet:
        async with httpx.AsyncClient(base_url=fleet.plc_url) as http:
            for acct in fleet.accounts:
                assert (await http.get(f"/{acct.did}")).json()["id"] == acct.did
            assert (await http.post(f"/{fleet.accounts[0].did}", content=b"{}")).status_code == 405
        assert fleet.plc.requests == 4 and fleet.plc.connections == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", int(fleet.plc_url.rsplit(":", 1)[1]))
        writer.write(b"garbage\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, server still up
        writer.close()
        async with httpx.AsyncClient(base_url=fleet.plc_url) as http:
            assert (await http.get(f"/{fleet.accounts[1].did}")).status_code == 200


def test_stream_log_byte_bound_keeps_the_newest_frames() -> None:
    log = StreamLog(limit=1000, byte_limit=1000)
    for seq in range(1, 101):
        log.append(LogEntry(seq, bytes(100)))
        assert log.size == sum(len(e.frame) for e in log.entries) <= 1250
        assert log.seqs == [e.seq for e in log.entries] and log.entries[-1].seq == seq
    assert 10 <= len(log.entries) <= 12 and log.base == 100 - len(log.entries)
    assert log.get(log.index_from(95)).seq == 95
    log.append(LogEntry(101, bytes(5000)))  # larger than the bound: kept alone
    assert [e.seq for e in log.entries] == [101] and log.size == 5000
    log.clear()
    assert log.size == 0 and log.base == 101
