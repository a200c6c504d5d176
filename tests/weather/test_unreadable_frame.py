"""An unreadable frame in the middle of a backlog costs only itself: every good commit after it
arrives, and the host keeps flowing live."""

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


async def test_every_good_commit_after_an_unreadable_frame_arrives(tmp_path: Path) -> None:
    async with weather(tmp_path, SimConfig(hosts=1, accounts_per_host=4, seed=62)) as (fleet, relay, consumer):
        before = await fleet.generate(10)
        bad = await fleet.emit("unreadable", fleet.accounts[0])
        after = await fleet.generate(100)
        assert [t.reason for t in bad] == ["bad_body_cbor"]
        await crawl_all(relay, fleet)
        want = commit_revs(before + after)
        try:
            await until(lambda: want <= consumer.arrived.keys(), "the backlog's good commits", timeout=30)
        except AssertionError:
            lost = [k for k in commit_revs(after) if k not in consumer.arrived]
            raise AssertionError(f"{len(lost)} of {len(commit_revs(after))} good commits after the unreadable "
                                 f"frame never arrived") from None
        assert bad[0].rev not in {e.rev for e in consumer.events}
        await assert_prompt(consumer, await paced(fleet, fleet.accounts, rounds=3, every=0.2))
        await all_synced(relay, fleet)
        await assert_delivered(fleet, consumer)
