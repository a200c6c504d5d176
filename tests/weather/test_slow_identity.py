"""Slow identity services hold only their own accounts: one host, many first-seen accounts, some
with handle domains that answer after 10 s (DNS TXT and the HTTPS method's address lookup) and
some whose DID documents take 4 s; once the healthy accounts are known, their commits, sent while
the slow ones are being handled, reach a consumer within 2 s of being sent."""

from __future__ import annotations

from pathlib import Path

from sim import SimConfig
from tests.waiting import until
from tests.weather.harness import (
    all_synced,
    assert_delivered,
    assert_prompt,
    commit_revs,
    crawl_all,
    paced,
    weather,
)

#: far beyond the 2 s bound: a relay that makes other accounts wait for these is far over it
SLOW_HANDLE_S = 10.0
#: under the relay's 10 s DID-directory timeout, so the slow documents do resolve
SLOW_DID_S = 4.0


async def test_healthy_accounts_flow_while_slow_identities_are_handled(tmp_path: Path) -> None:
    async with weather(tmp_path, SimConfig(hosts=1, accounts_per_host=60, seed=61)) as (fleet, relay, consumer):
        # the backlog announces the healthy accounts first, then the slow ones (more slow handle
        # checks than the relay's 16 identity requests in flight)
        healthy, slow_handles, slow_dids = fleet.accounts[:35], fleet.accounts[35:55], fleet.accounts[55:]
        fleet.slow_handle(slow_handles, SLOW_HANDLE_S)
        fleet.slow_did(slow_dids, SLOW_DID_S)
        known = commit_revs([t for t in fleet.ground_truth if t.did in {a.did for a in healthy}])
        await crawl_all(relay, fleet)
        await until(lambda: known <= consumer.arrived.keys(), "the healthy accounts' first commits")
        live = await paced(fleet, healthy, rounds=8, every=0.5)  # while the slow ones are handled
        await paced(fleet, slow_handles + slow_dids, rounds=2, every=0.5)
        delays = await assert_prompt(consumer, live)
        assert len(delays) == 8 * len(healthy)
        fleet.clear_weather()
        await fleet.commit(fleet.accounts)
        await all_synced(relay, fleet)
        await assert_delivered(fleet, consumer)
