"""getRepo served by the relay (``RELAY_GETREPO_PROXY``), over real sockets against the simulator:
N concurrent requests share one fetch from the PDS (counted at the simulated PDS), the CAR is
verified before it is served (a tampered one is refused, and not cached), a small cache serves
repeats until the relay knows a newer rev, ``since`` reaches the PDS, and a PDS that cannot be
reached gets the usual 302."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from mst.verify import verify_repo_car
from relay.repo_proxy import CarCache, VerifiedCar
from sim import SimConfig, SimFleet
from sim.host import GET_REPO_PATH
from tests.relay.e2e import Consumer, crawl, metric_value
from tests.relay.helpers import RunningRelay
from tests.waiting import until_async

GET_REPO = "/xrpc/com.atproto.sync.getRepo"


@contextlib.asynccontextmanager
async def _setup(relay_factory, **settings: object) -> AsyncIterator[tuple[SimFleet, RunningRelay]]:  # type: ignore[no-untyped-def]
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=91))
    await fleet.start()
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0,
                                 default_account_limit=1000, **settings) as relay:
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, fleet.hosts[0].hostname)
                await fleet.generate(6)
                valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
                await consumer.wait_for(lambda evs: len(evs) >= len(valid))
            yield fleet, relay
    finally:
        await fleet.stop()


async def _metric(relay: RunningRelay, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        return metric_value((await http.get(f"{relay.url}/metrics")).text, name, **labels)


async def test_concurrent_requests_share_one_verified_fetch(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with _setup(relay_factory, getrepo_proxy=True) as (fleet, relay):
        host, acct = fleet.hosts[0], fleet.accounts[0]
        n = 8
        host.hold_repos()
        async with httpx.AsyncClient(base_url=relay.url, timeout=30) as http:
            requests = [asyncio.create_task(http.get(GET_REPO, params={"did": acct.did})) for _ in range(n)]

            async def all_waiting() -> bool:  # n - 1 joined the fetch, which reached the PDS
                joined = await _metric(relay, "relay_getrepo_total", result="coalesced")
                return joined == n - 1 and host.requests[GET_REPO_PATH] == 1

            try:
                await until_async(all_waiting, "every request to wait for the one fetch")
            finally:
                host.release_repos()
            answers = await asyncio.gather(*requests)
            assert {r.status_code for r in answers} == {200}
            assert len({r.content for r in answers}) == 1
            assert answers[0].headers["content-type"] == "application/vnd.ipld.car"
            verified = verify_repo_car(answers[0].content, acct.did, acct.key.did_key())
            assert verified.commit.rev == acct.repo.rev
            assert host.requests[GET_REPO_PATH] == 1

            # a repeat is answered from the cache ...
            again = await http.get(GET_REPO, params={"did": acct.did})
            assert again.content == answers[0].content and host.requests[GET_REPO_PATH] == 1
            # ... until the relay holds a newer rev of the account
            while acct.repo.rev == verified.commit.rev:
                await fleet.generate(3)

            async def relay_has_it() -> bool:
                r = await http.get("/xrpc/com.atproto.sync.getLatestCommit", params={"did": acct.did})
                return bool(r.json().get("rev") == acct.repo.rev)

            await until_async(relay_has_it, "the relay to hold the new commit")
            newer = await http.get(GET_REPO, params={"did": acct.did})
            assert newer.status_code == 200 and host.requests[GET_REPO_PATH] == 2
            assert verify_repo_car(newer.content, acct.did, acct.key.did_key()).commit.rev == acct.repo.rev


async def test_since_is_passed_through(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with _setup(relay_factory, getrepo_proxy=True) as (fleet, relay):
        host, acct = fleet.hosts[0], fleet.accounts[1]
        since = "2222222222222"
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.get(GET_REPO, params={"did": acct.did, "since": since})
        assert r.status_code == 200
        assert host.repo_requests[-1] == {"did": acct.did, "since": since}


async def test_a_tampered_repository_is_refused_and_not_cached(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with _setup(relay_factory, getrepo_proxy=True) as (fleet, relay):
        host, acct = fleet.hosts[0], fleet.accounts[2]
        host.tampered_repos.add(acct.did)
        async with httpx.AsyncClient(base_url=relay.url) as http:
            for attempt in (1, 2):
                r = await http.get(GET_REPO, params={"did": acct.did})
                assert r.status_code == 502, r.text
                assert r.json()["error"] == "UpstreamFailure" and "car_hash_mismatch" in r.json()["message"]
                assert host.requests[GET_REPO_PATH] == attempt  # refused answers are not cached
            host.tampered_repos.clear()
            r = await http.get(GET_REPO, params={"did": acct.did})
            assert r.status_code == 200
            assert verify_repo_car(r.content, acct.did, acct.key.did_key()).commit.rev == acct.repo.rev
        assert await _metric(relay, "relay_getrepo_fetches_total", result="car_hash_mismatch") == 2
        assert await _metric(relay, "relay_getrepo_total", result="refused") == 2


async def test_unreachable_pds_gets_the_redirect(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with _setup(relay_factory, getrepo_proxy=True) as (fleet, relay):
        host, acct = fleet.hosts[0], fleet.accounts[0]
        await host.stop()
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.get(GET_REPO, params={"did": acct.did, "since": "2222222222222"})
        assert r.status_code == 302
        assert r.headers["location"] == f"{host.url}{GET_REPO}?did={acct.did.replace(':', '%3A')}&since=2222222222222"
        assert await _metric(relay, "relay_getrepo_total", result="fallback_redirect") == 1


async def test_off_by_default_redirects(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with _setup(relay_factory) as (fleet, relay):
        host, acct = fleet.hosts[0], fleet.accounts[0]
        async with httpx.AsyncClient(base_url=relay.url) as http:
            r = await http.get(GET_REPO, params={"did": acct.did})
        assert r.status_code == 302 and host.requests[GET_REPO_PATH] == 0


def test_the_cache_is_bounded_in_bytes() -> None:
    cache = CarCache(1000)
    for i in range(10):
        cache.put((f"did:plc:{i}", None), VerifiedCar(bytes(200), f"rev{i}"))
    assert cache.bytes <= 1000
    assert cache.get(("did:plc:0", None)) is None and cache.get(("did:plc:9", None)) is not None
    cache.get(("did:plc:5", None))  # used: survives the next eviction
    cache.put(("did:plc:x", None), VerifiedCar(bytes(200), "x"))
    assert cache.get(("did:plc:5", None)) is not None and cache.get(("did:plc:6", None)) is None
    cache.put(("did:plc:big", None), VerifiedCar(bytes(251), "big"))  # over a quarter: not cached
    assert cache.get(("did:plc:big", None)) is None and cache.bytes <= 1000
