"""Key rotations during start-up: a relay catching up with a backlog behind slow identity checks
while accounts rotate their keys rejects no commit that was valid when it was sent.

The rotating accounts are first seen after a backlog longer than a host's frames in flight,
behind first-seen accounts whose handle checks take 10 s; they rotate their keys once the relay
has their commits or 10 s later, whichever comes first (the network does not wait)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from sim import SimConfig
from tests.relay.e2e import metric_value
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


async def test_no_valid_commit_is_rejected_across_rotations_at_start_up(tmp_path: Path) -> None:
    config = SimConfig(hosts=1, accounts_per_host=40, seed=64, announce_accounts=False)
    async with weather(tmp_path, config) as (fleet, relay, consumer):
        slow, rotators, others = fleet.accounts[:10], fleet.accounts[10:16], fleet.accounts[16:]
        fleet.slow_handle(slow, 10.0)
        await fleet.announce(slow)
        await fleet.commit(others, per_account=25)  # 600 frames: more than a host's 512 in flight
        before = commit_revs(await fleet.commit(rotators, per_account=3))
        await crawl_all(relay, fleet)
        await until(lambda: fleet.hosts[0].subscriber_count > 0, "the relay to subscribe")
        live = await paced(fleet, others, rounds=3, every=0.5)
        with contextlib.suppress(AssertionError):  # rotations do not wait for a relay that lags
            await until(lambda: before <= consumer.arrived.keys(), "the rotating accounts' commits", timeout=10)
        await fleet.rotate_keys(rotators)
        await fleet.commit(rotators, per_account=3)
        fleet.clear_weather()
        await fleet.commit(fleet.accounts)  # the slow accounts' first commits
        await all_synced(relay, fleet)
        await assert_delivered(fleet, consumer)
        async with httpx.AsyncClient(base_url=relay.url) as http:
            text = (await http.get("/metrics")).text
        assert metric_value(text, "relay_verdicts_total", reason="bad_signature") == 0
        await assert_prompt(consumer, live)
