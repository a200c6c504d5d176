"""A host that was wiped and restored from a backup is picked up again, over real sockets.

The simulator's ``wipe_restore`` fault empties the host's log, restarts its seq at 1 and rolls
every account back by one commit. The relay, reconnecting with its old cursor, is answered
``FutureCursor``: it must reset the host's cursor, read the new stream from its start (nothing
the host emitted since the restart is missed), count and log the reset, and keep the accounts
honest: a rolled-back account's next commit does not chain, so it is resynchronised (``#sync`` at
the repository the host now serves) instead of being accepted on top of the lost commit.
"""

from __future__ import annotations

import logging
from collections import Counter

import httpx
import pytest

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, metric_value


async def test_wiped_host_is_followed_again_and_its_accounts_resynced(
        relay_factory, database_url: str, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=61))
    await fleet.start()
    host = fleet.hosts[0]
    try:
        async with relay_factory(database_url=database_url, allow_insecure_hosts=True, plc_url=fleet.plc_url,
                                 validation_workers=0, default_account_limit=1000) as relay:
            upstreams = relay.service.upstreams
            assert upstreams is not None
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, host.hostname)
                await fleet.generate(24)
                before = [t for t in fleet.ground_truth if t.verdict == "accept"]
                await consumer.wait_for(lambda evs: len(evs) >= len(before))
                await upstreams.settle_read(host.hostname)
                old_cursor = await relay.service.store.host_cursor(host.hostname)
                assert old_cursor == host.published_seq
                seen_before = len(consumer.events)

                held = {a.did: a.repo.rev for a in fleet.accounts}
                fleet.inject("wipe_restore", fleet.accounts[0])
                rolled = {a.did for a in fleet.accounts if a.repo.rev != held[a.did]}
                start = len(fleet.ground_truth)
                await fleet.generate(10)  # emitted before the relay reconnects: must not be skipped
                after = fleet.ground_truth[start:]
                assert host.published_seq == len(after) < old_cursor  # the old cursor is in the future
                desynced = {t.did for t in after if t.verdict == "desync"}
                assert desynced and desynced <= rolled
                fine = [t for t in after if t.verdict == "accept" and t.did not in desynced]

                def caught_up(evs: list) -> bool:  # type: ignore[type-arg]
                    new = evs[seen_before:]
                    got = Counter(key_of(e.t, e.did, e.rev) for e in new)
                    if any(got[key_of(t.kind, t.did, t.rev)] == 0 for t in fine):
                        return False
                    last = {e.did: e.rev for e in new if e.t in ("#commit", "#sync")}
                    return all(last.get(d) == fleet.by_did[d].repo.rev for d in desynced)

                await consumer.wait_for(caught_up)
                await upstreams.settle_read(host.hostname)
                latest = await relay.service.store.latest_seq()
                await consumer.wait_for(lambda evs: evs[-1].seq >= latest)
                async with httpx.AsyncClient(base_url=relay.url) as http:
                    text = (await http.get("/metrics")).text
                    status = {d: (await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": d})).json()
                              for d in desynced}

        new = consumer.events[seen_before:]
        check_stream(consumer.events)
        # nothing lost, nothing twice: every valid event of the new stream exactly once ...
        got = Counter(key_of(e.t, e.did, e.rev) for e in new if e.did not in desynced)
        assert got == Counter(key_of(t.kind, t.did, t.rev) for t in fine)
        # ... and each rolled-back account that committed again was resynchronised, not chained
        for did in desynced:
            mine = [e for e in new if e.did == did]
            syncs = [e for e in mine if e.t == "#sync"]
            assert len(syncs) == 1, mine
            assert all(e.rev > syncs[0].rev for e in mine if e.t == "#commit" and e.seq > syncs[0].seq)
            assert not [e for e in mine if e.t == "#commit" and e.seq < syncs[0].seq]  # none chained on the lost one
            assert status[did]["rev"] == fleet.by_did[did].repo.rev
        resets = metric_value(text, "relay_host_cursor_resets_total", host=host.hostname)
        assert resets == 1 and metric_value(text, "relay_host_cursor_resets_total", reason="future_cursor") == 1
        assert metric_value(text, "relay_verdicts_total", kind="desync", reason="since_mismatch") >= len(desynced)
        warned = [r for r in caplog.records if r.name == "relay.ingest.hostruns" and r.levelno == logging.WARNING
                  and "cursor reset" in r.getMessage()]
        assert warned
    finally:
        await fleet.stop()
