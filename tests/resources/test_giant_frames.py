"""Giant frames from simulated hosts stay within the ingest budget (README, "Memory budgets"):
three simulator hosts each start their backlog with a 5.3 MB frame (the simulator's ``oversized``
fault, rejected as ``frame_too_large`` by validation), then ordinary commits and more giant frames.
Each frame costs twice its size in the budget (``relay.ingest.hostruns.frame_cost``), so two hosts'
first frames fit ``RELAY_INGEST_BUFFER_MB`` and the third waits in line for them.

The validation worker is stopped (SIGSTOP, a real process) while the hosts are crawled, so frames
stay in flight: what is measured is the budget's own accounting (bytes taken, hosts waiting), not
the process's memory. Once it runs again every accepted event reaches a consumer exactly once.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import httpx
import pytest

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, metric_value
from tests.relay.helpers import running_relay
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)


async def test_giant_frames_wait_for_the_ingest_budget_and_none_is_lost(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=3, accounts_per_host=2, seed=27, announce_accounts=False))
    await fleet.start()
    limit_mb = 24
    try:
        for _ in range(2):  # each host: a giant frame first, then ordinary commits
            for host in fleet.hosts:
                await fleet.emit("oversized", next(a for a in fleet.accounts if a.host is host))
            await fleet.generate(12)
        # what the budget counts a frame as (``relay.ingest.hostruns.frame_cost``): twice it, plus 2 KiB
        giant = max(2 * len(e.frame) + 2048 for h in fleet.hosts for e in h.log.entries)
        assert 2 * giant <= limit_mb * 2**20 < 3 * giant
        async with running_relay(database_url=str(tmp_path / "relay.sqlite"), allow_insecure_hosts=True,
                                 plc_url=fleet.plc_url, validation_workers=1, ingest_buffer_mb=limit_mb) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            upstreams = relay.service.upstreams
            pool = relay.service.pool
            assert upstreams is not None and pool is not None
            budget = upstreams.budget
            peak = [0]
            take = budget.take

            async def watched_take(n: int) -> None:  # the real budget; its high-water mark noted
                await take(n)
                peak[0] = max(peak[0], budget.used)

            budget.take = watched_take  # type: ignore[method-assign]
            (worker,) = pool.worker_pids
            os.kill(worker, signal.SIGSTOP)
            try:
                for host in fleet.hosts:
                    await crawl(relay.url, host.hostname)
                await until(lambda: budget.waiting == 1, "the third host's giant frame waiting for the budget")
                assert budget.used <= limit_mb * 2**20
            finally:
                os.kill(worker, signal.SIGCONT)
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            await consumer.wait_for(lambda evs: len(evs) >= len(wanted), timeout=120)
            async with httpx.AsyncClient(base_url=relay.url) as http:
                text = (await http.get("/metrics")).text
        assert peak[0] <= limit_mb * 2**20
        assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == Counter(wanted)
        check_stream(consumer.events)
        assert metric_value(text, "relay_verdicts_total", reason="frame_too_large") == 6
    finally:
        await fleet.stop()

