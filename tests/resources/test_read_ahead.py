"""The WebSocket read-ahead of an upstream host is bounded (``SubscriberConfig.read_ahead_frames``):
the ingest budget counts a frame once it is dispatched, so what the connection reads ahead of a
host run waiting for the budget is outside it. One simulator host sends a backlog of giant frames
(5.3 MB each, the ``oversized`` fault); the validation worker is stopped (SIGSTOP, a real process)
so the host's run stops taking frames (its in-flight bytes are full). The connection must then stop reading
after a couple of messages, not hold a dozen giant frames (``websockets``' default keeps 16 and
more). Once the worker runs again every accepted event reaches a consumer exactly once.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of
from tests.relay.helpers import running_relay
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)

GIANTS = 12


async def test_a_hosts_read_ahead_stops_at_a_couple_of_giant_frames(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=31, announce_accounts=False))
    await fleet.start()
    try:
        (host,) = fleet.hosts
        (account,) = fleet.accounts
        await fleet.generate(1)
        for _ in range(GIANTS):
            await fleet.emit("oversized", account)
        await fleet.generate(1)
        giant = max(len(e.frame) for e in host.log.entries)
        assert giant > 5_000_000
        async with running_relay(database_url=str(tmp_path / "relay.sqlite"), allow_insecure_hosts=True,
                                 plc_url=fleet.plc_url, validation_workers=1) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            upstreams = relay.service.upstreams
            pool = relay.service.pool
            assert upstreams is not None and pool is not None
            (worker,) = pool.worker_pids
            os.kill(worker, signal.SIGSTOP)
            try:
                await crawl(relay.url, host.hostname)
                # the run dispatches a giant frame (counted twice its size), then waits for room
                # (the host's in-flight bytes) with the next in hand; the connection reads on until
                # its queue of whole messages passes the bound and it stops reading the socket
                def queued() -> tuple[int, int, bool]:
                    run = upstreams._runs.get(host.hostname)
                    ws = None if run is None else run.subscriber._ws
                    if ws is None:
                        return 0, 0, False
                    frames = list(ws.recv_messages.frames.queue)
                    return len(frames), sum(len(f.data) for f in frames), ws.recv_messages.paused

                await until(lambda: queued()[2] or queued()[0] > 2, "the host's connection to stop reading", timeout=25)
                count, held, paused = queued()
                assert paused
                assert count <= 2, f"{count} whole messages read ahead ({held / 1e6:.0f} MB)"
                assert held <= 2 * giant
            finally:
                os.kill(worker, signal.SIGCONT)
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            await consumer.wait_for(lambda evs: len(evs) >= len(wanted), timeout=150)
        assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == Counter(wanted)
        check_stream(consumer.events)
    finally:
        await fleet.stop()
