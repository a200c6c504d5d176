"""A host whose getRepo fails for a while: an account desynchronized by a broken chain cannot be
repaired meanwhile; once getRepo works again the account is synced (within 60 s) and its later
commits arrive. The other accounts of the host flow promptly all along.

The worst case is made certain: the broken account falls quiet before the last failed getRepo
(nothing it sends brings the next attempt forward), so only the relay's own retry timer can
notice that the host works again, and it must do so within the 60 s."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sim import SimConfig, TruthEvent
from tests.waiting import until
from tests.weather.harness import (
    SYNCED_WITHIN,
    all_synced,
    assert_delivered,
    assert_prompt,
    commit_revs,
    crawl_all,
    weather,
)

#: getRepo answers for the broken account that fail before it works again (more than the 5
#: attempts after which a relay that gives up stops retrying)
FAILED_FETCHES = 7


async def test_account_is_repaired_once_getrepo_works_again(tmp_path: Path) -> None:
    async with weather(tmp_path, SimConfig(hosts=1, accounts_per_host=6, seed=63)) as (fleet, relay, consumer):
        host = fleet.hosts[0]
        victim, healthy = fleet.accounts[0], fleet.accounts[1:]
        await crawl_all(relay, fleet)
        first = commit_revs(await fleet.commit(fleet.accounts))
        await until(lambda: first <= consumer.arrived.keys(), "every account's first commit")
        host.fail_repos("500", dids={victim.did}, requests=FAILED_FETCHES)
        broken = await fleet.emit("broken_chain", victim)
        assert [t.verdict for t in broken] == ["desync"]
        live: list[TruthEvent] = []
        served, deadline = 0, time.monotonic() + SYNCED_WITHIN
        while host.repo_failures_served < FAILED_FETCHES:  # the weather: the healthy keep posting
            if host.repo_failures_served > served:
                served, deadline = host.repo_failures_served, time.monotonic() + SYNCED_WITHIN
            assert time.monotonic() < deadline, (
                f"the relay stopped fetching the desynchronized account's repository after "
                f"{served} failed getRepo (the host fails {FAILED_FETCHES}, then works)")
            live += await fleet.commit(healthy)
            if served < FAILED_FETCHES - 1:  # the victim too, until just before its last failure
                await fleet.commit([victim])
            await asyncio.sleep(0.5)
        await assert_prompt(consumer, live)
        await all_synced(relay, fleet)
        later = commit_revs(await fleet.commit([victim], 3))
        await until(lambda: later <= consumer.arrived.keys(), "the repaired account's later commits")
        await assert_delivered(fleet, consumer, covered=[victim])
        assert any(e.t == "#sync" and e.did == victim.did for e in consumer.events)
