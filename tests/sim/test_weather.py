"""The simulator's weather: slow or failing DID directory, handle domains and getRepo."""

from __future__ import annotations

import asyncio
import random

import dns.exception
import httpx
import pytest

from firehose.frames import FrameError, decode_frame
from relay.config import parse_nameservers
from relay.identity import did_from_txt, dns_txt_lookup
from relay.ssrf import SSRFError
from sim import Delay, SimConfig, SimFleet

GET_REPO = "/xrpc/com.atproto.sync.getRepo"


def test_tail_delay_has_the_quantiles_it_is_given() -> None:
    rng = random.Random(1)
    dist = Delay.tail(0.05, 3.0)
    samples = sorted(dist.sample(rng) for _ in range(20_000))
    assert 0.04 < samples[10_000] < 0.06
    assert 2.4 < samples[19_800] < 3.6
    assert samples[-1] <= dist.cap
    assert Delay.parse("2") == Delay.fixed(2.0) and Delay.parse("0.05/3") == dist


async def test_slow_did_answers_late_with_the_document_as_it_was_asked() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=1)) as fleet:
        slow, fast = fleet.accounts
        fleet.slow_did([slow], 1.0)
        async with httpx.AsyncClient(base_url=fleet.plc_url, timeout=10) as http:
            asked = asyncio.ensure_future(http.get(f"/{slow.did}"))
            assert (await http.get(f"/{fast.did}")).status_code == 200  # others are not held
            await asyncio.sleep(0)  # the slow request is in the directory's hands
            old_key = slow.key.multibase
            fleet.inject("key_rotation", slow)  # the document changes while the answer is held
            done, _ = await asyncio.wait({asked}, timeout=0.5)
            assert not done, "the slow DID was answered before its delay"
            doc = (await asked).json()
            assert doc["verificationMethod"][0]["publicKeyMultibase"] == old_key
            fleet.plc.did_failures[fast.did] = 503
            assert (await http.get(f"/{fast.did}")).status_code == 503


async def test_handle_domains_over_dns_slow_failing_and_resolved() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=2, dns=True)) as fleet:
        assert fleet.dns is not None
        ok, slow, failing = fleet.accounts
        fleet.slow_handle([slow], 2.0)
        fleet.slow_handle([failing], fail="nxdomain")
        lookup = dns_txt_lookup(parse_nameservers(fleet.dns.address), timeout=1.0)
        assert lookup is not None
        assert did_from_txt(await lookup(f"_atproto.{ok.handle}")) == ok.did
        assert await lookup(f"_atproto.{failing.handle}") == []
        with pytest.raises(dns.exception.Timeout):
            await lookup(f"_atproto.{slow.handle}")  # answered after 2 s: the client gave up at 1 s
        assert await fleet.dns.resolve_address(ok.handle) == ["127.0.0.1"]
        with pytest.raises(SSRFError):
            await fleet.dns.resolve_address(failing.handle)
        fleet.slow_handle([slow, failing])  # weather cleared
        assert did_from_txt(await lookup(f"_atproto.{slow.handle}")) == slow.did
        assert did_from_txt(await lookup(f"_atproto.{failing.handle}")) == failing.did
        async with httpx.AsyncClient(base_url=fleet.plc_url) as http:
            r = await http.get("/xrpc/com.atproto.identity.resolveHandle", params={"handle": ok.handle})
            assert r.json() == {"did": ok.did}


async def test_getrepo_fails_for_a_number_of_requests_then_works() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=3)) as fleet:
        host = fleet.hosts[0]
        broken, other = fleet.accounts
        host.fail_repos("500", dids={broken.did}, requests=2)
        async with httpx.AsyncClient(base_url=host.url, timeout=10) as http:
            assert (await http.get(GET_REPO, params={"did": other.did})).status_code == 200
            codes = [(await http.get(GET_REPO, params={"did": broken.did})).status_code for _ in range(3)]
            assert codes == [500, 500, 200]
            host.fail_repos("404")
            assert (await http.get(GET_REPO, params={"did": other.did})).status_code == 404
            host.fail_repos("timeout")
            hanging = asyncio.ensure_future(http.get(GET_REPO, params={"did": other.did}))
            done, _ = await asyncio.wait({hanging}, timeout=0.3)
            assert not done
            host.heal_repos()
            assert (await hanging).status_code == 504
            assert (await http.get(GET_REPO, params={"did": other.did})).status_code == 200
        assert host.repo_failures_served == 4


async def test_unreadable_frame_at_a_chosen_position() -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=4, announce_accounts=False)) as fleet:
        acct = fleet.accounts[0]
        await fleet.commit([acct], 2)
        bad = await fleet.emit("unreadable", acct)
        after = await fleet.commit([acct], 2)
        assert [t.verdict for t in bad] == ["reject"] and bad[0].reason == "bad_body_cbor"
        log = fleet.hosts[0].log.entries
        assert [e.seq for e in log] == [1, 2, 3, 4, 5]
        with pytest.raises(FrameError):
            decode_frame(log[2].frame)
        assert [decode_frame(e.frame).body["rev"] for e in log[3:]] == [t.rev for t in after]
        assert bad[0].rev not in {t.rev for t in after}
