"""``com.atproto.sync.listReposByCollection`` against a full walk of every simulated repository."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from sim import SimConfig, SimFleet
from tests.relay.e2e import crawl


def walk(fleet: SimFleet) -> dict[str, Counter[str]]:
    """did → records per collection, from each simulated repository's own record list."""
    return {a.did: Counter(p.partition("/")[0] for p in a.repo.records()) for a in fleet.accounts}


async def listing(http: httpx.AsyncClient, collection: str, limit: int) -> list[str]:
    dids: list[str] = []
    cursor: str | None = None
    while True:
        params = {"collection": collection, "limit": str(limit), **({"cursor": cursor} if cursor else {})}
        r = await http.get("/xrpc/com.atproto.sync.listReposByCollection", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        dids += [repo["did"] for repo in body["repos"]]
        cursor = body.get("cursor")
        if cursor is None:
            return dids


async def test_table_matches_a_full_walk_of_every_repository(relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=4, seed=80))
    await fleet.start()
    try:
        # broken chains desynchronise accounts: their repair (#sync) rebuilds their counts from the
        # whole repository fetched from the host
        fleet.hosts[1].set_fault("broken_chain", 0.08)
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                    "default_account_limit": 1000}
        async with relay_factory(database_url=database_url, **settings) as relay:
            for host in fleet.hosts:
                await crawl(relay.url, host.hostname)
            store = relay.service.store
            for _ in range(8):
                await fleet.generate(40)
            truth = {a.did: a.repo.rev for a in fleet.accounts}
            deadline = time.monotonic() + 60
            while True:  # every account at its host's rev (resyncs included)
                heads = {did: (await store.get_account(did)) for did in truth}
                if all(h is not None and h.rev == truth[did] and h.sync_state == "synced" for did, h in heads.items()):
                    break
                assert time.monotonic() < deadline, "accounts did not catch up"
                await asyncio.sleep(0.05)
            assert any(t.verdict == "desync" for t in fleet.ground_truth), "no resync was exercised"
            expected = walk(fleet)
            for did, counts in expected.items():
                assert await store.collection_counts(did) == dict(counts), did
            collections = sorted({c for counts in expected.values() for c in counts})
            assert len(collections) >= 4
            async with httpx.AsyncClient(base_url=relay.url) as http:
                for collection in collections:
                    want = sorted(did for did, counts in expected.items() if counts[collection] > 0)
                    assert await listing(http, collection, limit=3) == want, collection
                # an account that is not active is not listed
                gone = fleet.accounts[0]
                fleet.set_status(gone, "deactivated")
                await fleet.generate(1)
                deadline = time.monotonic() + 30
                while (await store.get_account(gone.did)).upstream_status == "active":  # type: ignore[union-attr]
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                some = next(c for c in collections if expected[gone.did][c] > 0)
                assert gone.did not in await listing(http, some, limit=500)
                r = await http.get("/xrpc/com.atproto.sync.listReposByCollection", params={"collection": "nope"})
                assert r.status_code == 400 and r.json()["error"] == "InvalidRequest"
                r = await http.get("/xrpc/com.atproto.sync.listReposByCollection",
                                   params={"collection": collections[0], "limit": "2001"})
                assert r.status_code == 400
                # a query: POST (or any method but GET/HEAD) is refused as the wrong method
                r = await http.post("/xrpc/com.atproto.sync.listReposByCollection",
                                    params={"collection": collections[0]})
                assert r.status_code == 405 and r.json()["error"] == "MethodNotAllowed"
    finally:
        await fleet.stop()
