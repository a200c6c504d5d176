"""Every fault mode yields the verdict ``fleet.ground_truth`` expects from the relay's validation.

Frames are read from the hosts over real WebSockets and judged by ``tests.sim.harness.RelayJudge``
(``firehose.validate`` plus the relay's seq and host checks) in global emission order.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from firehose.frames import decode_frame
from sim import EXPECTED, SimConfig, SimFleet
from sim.faults import ACCOUNT_FAULTS, CONNECTION_FAULTS, FRAME_FAULTS, WIPE_FAULTS
from tests.sim.harness import RelayJudge, read_frames, ws_url
from tests.waiting import until


async def _judge_all(fleet: SimFleet, steps: int = 0) -> list[tuple[object, object]]:
    """Pairs (truth, judged) for every event of every host, in emission order.

    With ``steps`` the fleet generates one commit at a time and each step's frames are judged
    before the next step, like a relay that keeps up: a key rotation or a migration then never
    overtakes the commits emitted before it.
    """
    from websockets.asyncio.client import connect

    queues: dict[str, asyncio.Queue[bytes]] = {h.hostname: asyncio.Queue() for h in fleet.hosts}

    async def pump(url: str, q: asyncio.Queue[bytes]) -> None:
        async with connect(ws_url(url, 0), max_size=None) as ws:
            async for msg in ws:
                q.put_nowait(msg)  # type: ignore[arg-type]

    readers = [asyncio.create_task(pump(h.url, queues[h.hostname])) for h in fleet.hosts]
    judge = RelayJudge(fleet.plc_url)
    urls = {h.hostname: h.url for h in fleet.hosts}
    pairs = []
    done = 0
    try:
        for _ in range(max(steps, 1)):
            if steps:
                await fleet.generate(1)
            for truth in fleet.ground_truth[done:]:
                raw = await asyncio.wait_for(queues[truth.host].get(), 10)
                pairs.append((truth, await judge.judge(urls[truth.host], raw)))
            done = len(fleet.ground_truth)
        # nothing else was sent: the next frame of each host is a marker emitted now
        for marker in await fleet.markers():
            raw = await asyncio.wait_for(queues[marker.host].get(), 10)
            assert decode_frame(raw).body["seq"] == marker.upstream_seq, "frames without ground truth"
            pairs.append((marker, await judge.judge(urls[marker.host], raw)))
    finally:
        for r in readers:
            r.cancel()
        await judge.close()
    return pairs


def _check(pairs: list) -> Counter:
    seen: Counter = Counter()
    for truth, judged in pairs:
        v = judged.verdict
        undecodable = truth.reason in ("frame_too_large", "bad_body_cbor")  # refused before decoding
        if not undecodable:
            assert (judged.kind, judged.did, judged.seq) == (truth.kind, truth.did, truth.upstream_seq or judged.seq)
        if truth.kind == "#commit" and not undecodable:
            assert judged.rev == truth.rev
        assert v.kind == truth.verdict, (truth, v)
        if truth.verdict != "accept":
            assert v.reason == truth.reason, (truth, v)
        seen[(truth.fault, truth.verdict)] += 1
    return seen


async def test_clean_fleet_every_frame_is_accepted() -> None:
    async with SimFleet(SimConfig(hosts=2, accounts_per_host=5, seed=21)) as fleet:
        await fleet.generate(150)
        pairs = await _judge_all(fleet)
        assert len(pairs) == len(fleet.ground_truth) >= 150 + 30
        assert all(j.verdict.kind == "accept" for _, j in pairs)
        assert {t.kind for t, _ in pairs} == {"#commit", "#identity", "#account"}


@pytest.mark.parametrize("kind", [k for k in FRAME_FAULTS if k not in WIPE_FAULTS] + list(ACCOUNT_FAULTS))
async def test_fault_mode_verdicts_match_ground_truth(kind: str) -> None:
    async with SimFleet(SimConfig(hosts=2, accounts_per_host=3, seed=30)) as fleet:
        rate = 0.1 if kind == "oversized" else 0.25
        for h in fleet.hosts:
            h.set_fault(kind, rate)
        seen = _check(await _judge_all(fleet, steps=40))
        injected = sum(n for (fault, _), n in seen.items() if fault == kind)
        assert injected > 0, f"{kind} never fired: {seen}"
        if kind in EXPECTED:
            assert seen[(kind, EXPECTED[kind][0])] > 0
        # everything not caused by the fault is accepted
        assert all(v == "accept" for (fault, v) in seen if fault != kind)


async def test_account_faults_update_plc_and_hosts() -> None:
    async with SimFleet(SimConfig(hosts=2, accounts_per_host=2, seed=33)) as fleet:
        acct = fleet.accounts[0]
        old_host, old_key = acct.host, acct.key.did_key()
        fleet.inject("key_rotation", acct)
        fleet.inject("migration", acct)
        await fleet.generate(1)
        async with httpx.AsyncClient() as http:
            doc = (await http.get(f"{fleet.plc_url}/{acct.did}")).json()
            assert doc["verificationMethod"][0]["publicKeyMultibase"] != old_key.removeprefix("did:key:")
            assert doc["service"][0]["serviceEndpoint"] == acct.host.url != old_host.url
            r = await http.get(f"{old_host.url}/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})
            assert r.json()["error"] == "RepoNotFound"
            r = await http.get(f"{acct.host.url}/xrpc/com.atproto.sync.getLatestCommit", params={"did": acct.did})
            assert r.json()["rev"] == acct.repo.rev
        mine = [(t.host, t.kind, t.fault, t.verdict) for t in fleet.ground_truth if t.did == acct.did][3:]
        new, old = acct.host.hostname, old_host.hostname
        assert mine[:5] == [
            (old, "#identity", "key_rotation", "accept"),
            (new, "#identity", "migration", "accept"),
            (new, "#account", "migration", "accept"),
            (new, "#sync", "migration", "accept"),
            (old, "#account", "migration", "reject"),
        ]


async def test_wiped_host_restarts_seq_and_refuses_old_cursor() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=34)) as fleet:
        host = fleet.hosts[0]
        await fleet.generate(10)
        before = host.published_seq
        assert before > 10
        reader = asyncio.create_task(read_frames(host.url, before, idle=2.0))
        await until(lambda: host.subscriber_count > 0, "the reader subscribed")
        fleet.inject("seq_backwards", fleet.accounts[0])
        await fleet.generate(5)
        frames, closed = await reader
        assert closed  # the wipe dropped the connection
        assert host.published_seq == 5
        frames, closed = await read_frames(host.url, before)
        assert decode_frame(frames[0]).body["error"] == "FutureCursor" and closed
        frames, _ = await read_frames(host.url, 0)
        assert [decode_frame(f).body["seq"] for f in frames] == [1, 2, 3, 4, 5]
        after = [t for t in fleet.ground_truth if t.fault == "seq_backwards"]
        assert len(after) == 1 and after[0].upstream_seq == 1 and after[0].verdict == "accept"


async def test_wipe_restore_rolls_accounts_back_so_their_next_commit_does_not_chain() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=35)) as fleet:
        host = fleet.hosts[0]
        await fleet.generate(12)
        held = {a.did: a.repo.rev for a in fleet.accounts}
        fleet.inject("wipe_restore", fleet.accounts[0])
        rolled = {a.did for a in fleet.accounts if a.repo.rev != held[a.did]}
        assert rolled and all(fleet.by_did[d].repo.rev < held[d] for d in rolled)  # type: ignore[operator]
        before = len(fleet.ground_truth)
        await fleet.generate(30)
        truth = fleet.ground_truth[before:]
        assert [t.upstream_seq for t in truth] == list(range(1, len(truth) + 1))  # the stream restarted
        firsts = {}
        for t in truth:
            firsts.setdefault(t.did, t)
        assert {d for d in rolled if d in firsts}, "no rolled-back account committed again"
        for did, t in firsts.items():
            want = ("desync", "since_mismatch", "wipe_restore") if did in rolled else ("accept", None, None)
            assert (t.verdict, t.reason, t.fault if did in rolled else None) == want
        assert all(t.verdict == "accept" for t in truth if firsts[t.did] is not t)
        frames, _ = await read_frames(host.url, 0, count=len(truth))
        for raw in frames:
            body = decode_frame(raw).body
            if body["repo"] in rolled and firsts[body["repo"]].upstream_seq == body["seq"]:
                assert body["since"] < held[body["repo"]] < body["rev"]  # it skips the lost commit
        async with httpx.AsyncClient() as http:  # the host serves the restored repository
            for acct in fleet.accounts:
                r = await http.get(f"{host.url}/xrpc/com.atproto.sync.getLatestCommit", params={"did": acct.did})
                assert r.json()["rev"] == acct.repo.rev


async def _follow(url: str, want: int, limit: float = 30.0) -> tuple[list[int], int, list[float]]:
    """A client that reconnects with its cursor; returns (seqs, connections, receive gaps)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    seqs: list[int] = []
    gaps: list[float] = []
    connections = 0
    deadline = time.monotonic() + limit
    while len(seqs) < want and time.monotonic() < deadline:
        cursor = seqs[-1] if seqs else 0  # the last seq received: the host sends seq > cursor
        connections += 1
        try:
            async with connect(ws_url(url, cursor), max_size=None) as ws:
                last = time.monotonic()
                while len(seqs) < want:
                    raw = await asyncio.wait_for(ws.recv(), deadline - time.monotonic())
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    seq = decode_frame(raw).body["seq"]
                    if not seqs or seq > seqs[-1]:
                        seqs.append(seq)
        except ConnectionClosed:
            continue
    return seqs, connections, gaps


@pytest.mark.parametrize("kind", CONNECTION_FAULTS)
async def test_connection_faults_lose_nothing(kind: str) -> None:
    cfg = SimConfig(hosts=1, accounts_per_host=4, seed=40, slow_delay=0.05, stall_seconds=0.6)
    async with SimFleet(cfg) as fleet:
        host = fleet.hosts[0]
        start = host.published_seq
        follower = asyncio.create_task(_follow(host.url, start + 30))
        await until(lambda: host.subscriber_count > 0, "the follower to subscribe")
        host.set_fault(kind, 0.2)
        truth = await fleet.generate(30)
        seqs, connections, gaps = await follower
        assert seqs == list(range(1, start + 31))
        affected = [t for t in truth if t.fault == kind]
        assert affected and all(t.valid for t in truth)
        if kind == "disconnect":
            assert connections > 1
        elif kind == "stall":
            assert max(gaps) >= 0.5
        else:
            assert sum(1 for g in gaps if g >= 0.04) >= 1


async def test_drop_connections_on_demand_keeps_the_log() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=41)) as fleet:
        host = fleet.hosts[0]
        start = host.published_seq
        follower = asyncio.create_task(_follow(host.url, start + 40))
        await until(lambda: host.subscriber_count > 0, "the follower to subscribe")
        assert host.drop_connections() == 1
        for _ in range(4):
            await fleet.generate(10)
            for _ in range(100):  # the follower reconnects with its cursor
                if host.subscriber_count:
                    break
                await asyncio.sleep(0.02)
            host.drop_connections()
        seqs, connections, _ = await follower
        assert seqs == list(range(1, start + 41))
        assert connections > 1 and host.connections_dropped >= 2
