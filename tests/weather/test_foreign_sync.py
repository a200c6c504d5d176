"""Only the account's own PDS speaks for it: a ``#sync`` for an account, sent by another host the
relay follows (signed with the account's real key, a newer rev), is refused (``wrong_host``) and
the account goes on as before."""

from __future__ import annotations

from pathlib import Path

import httpx

from sim import SimConfig
from tests.relay.e2e import metric_value
from tests.waiting import until, until_async
from tests.weather.harness import (
    all_synced,
    assert_delivered,
    assert_prompt,
    commit_revs,
    crawl_all,
    paced,
    weather,
)


async def test_sync_from_a_host_that_is_not_the_accounts_pds_is_refused(tmp_path: Path) -> None:
    async with weather(tmp_path, SimConfig(hosts=2, accounts_per_host=3, seed=65)) as (fleet, relay, consumer):
        victim = fleet.accounts[0]
        await crawl_all(relay, fleet)
        first = commit_revs(await fleet.commit(fleet.accounts))
        await until(lambda: first <= consumer.arrived.keys(), "every account's first commit")
        foreign = await fleet.emit("foreign_sync", victim)
        assert [(t.kind, t.verdict, t.reason) for t in foreign] == [("#sync", "reject", "wrong_host")]
        assert foreign[0].host != victim.host.hostname

        async with httpx.AsyncClient(base_url=relay.url) as http:
            async def judged() -> bool:  # refused (counted) or, when the guard is broken, passed on
                text = (await http.get("/metrics")).text
                return (metric_value(text, "relay_verdicts_total", kind="reject", reason="wrong_host") >= 1
                        or any(e.t == "#sync" for e in consumer.events))

            await until_async(judged, "the relay to judge the foreign #sync")
        assert not [e for e in consumer.events if e.t == "#sync"], "a #sync from a host that is not the PDS passed"
        await assert_prompt(consumer, await paced(fleet, fleet.accounts, rounds=3, every=0.2))
        await all_synced(relay, fleet)
        await assert_delivered(fleet, consumer)
