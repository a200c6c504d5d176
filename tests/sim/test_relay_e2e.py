"""The whole relay (``relay serve`` as a child process) against a faulty simulated fleet.

The consumer must receive exactly the events the ground truth calls valid, once each, in order,
and the relay's verdict counters must show every expected rejection/desync/ignore reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from bench._common import metric_sum, relay
from firehose.frames import decode_frame
from sim import SimConfig, SimFleet
from tests.waiting import until


def _key(kind: str, did: str, rev: str | None) -> tuple[str, str, str | None]:
    return (kind, did, rev if kind in ("#commit", "#sync") else None)


async def test_relay_output_matches_ground_truth() -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=4, seed=50))
    await fleet.start()
    try:
        for kind, rate in (("bad_signature", 0.1), ("missing_block", 0.1), ("broken_chain", 0.15),
                           ("duplicate", 0.1), ("replay", 0.1)):
            fleet.hosts[0].set_fault(kind, rate)
        fleet.hosts[1].set_fault("deactivate", 0.1)
        fleet.hosts[1].set_fault("takedown", 0.1)
        fleet.hosts[1].set_fault("bad_signature", 0.1)
        async with relay(fleet.plc_url, extra=["--validation-workers", "0"]) as r:
            got: list[tuple[int, str, str, str | None]] = []

            async def consume() -> None:
                # From the start (whenever it connects), and on after the last seq if the
                # connection drops: a starved machine can miss a keepalive, and a consumer that
                # resumes by cursor must still see everything exactly once.
                while True:
                    cursor = got[-1][0] if got else 0
                    with contextlib.suppress(ConnectionClosed, OSError):
                        async with connect(f"{r.ws_url}?cursor={cursor}", max_size=None) as ws:
                            async for msg in ws:
                                f = decode_frame(msg)  # type: ignore[arg-type]
                                if f.t in ("#commit", "#sync", "#identity", "#account"):
                                    b = f.body
                                    got.append((b["seq"], f.t, b.get("repo") or b.get("did"), b.get("rev")))
                    await asyncio.sleep(0.1)

            reader = asyncio.create_task(consume())
            await r.crawl([h.hostname for h in fleet.hosts])
            for _ in range(100):  # small steps: the relay keeps up, as the ground truth assumes
                await fleet.generate(1)
                await asyncio.sleep(0.02)
            n_valid = sum(1 for t in fleet.ground_truth if t.verdict == "accept")
            await until(lambda: len(got) >= n_valid - 20, "most of the valid events", timeout=60)
            deadline = time.monotonic() + 60
            while metric_sum(await r.metrics(), "relay_resync_queue") > 0:  # every resync finished
                assert time.monotonic() < deadline, "resyncs still pending after 60 s"
                await asyncio.sleep(0.1)
            # a marker from every host: anything extra (a duplicate, an invalid event) comes before it
            revs = {t.rev for t in await fleet.markers()}
            await until(lambda: revs <= {rv for _, k, _, rv in got if k == "#commit"}, "the markers", timeout=60)
            metrics = await r.metrics()
            reader.cancel()
    finally:
        await fleet.stop()
    # desync: the commit that reveals a gap is not redistributed; the relay resyncs the account
    # from its host and announces the new state with a #sync, which may supersede commits that
    # were still in flight (they are then not redistributed either: the #sync covers them)
    relayed = Counter(_key(k, d, rv) for _, k, d, rv in got if k != "#sync")
    synced: dict[str, str] = {}
    for _, k, d, rv in got:
        if k == "#sync" and rv is not None:
            synced[d] = max(synced.get(d, ""), rv)
    desynced_at: dict[str, str] = {}
    for t in fleet.ground_truth:
        if t.verdict == "desync" and t.rev is not None:
            desynced_at.setdefault(t.did, t.rev)
    assert set(desynced_at) <= set(synced), "every desynchronised account is resynced"

    def covered(t) -> bool:  # type: ignore[no-untyped-def]
        return (t.kind == "#commit" and t.did in desynced_at and t.rev is not None
                and desynced_at[t.did] <= t.rev <= synced[t.did])

    must = Counter(_key(t.kind, t.did, t.rev) for t in fleet.ground_truth
                   if t.verdict == "accept" and not covered(t))
    may = Counter(_key(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept" and covered(t))
    assert relayed - may == must
    seqs = [s for s, *_ in got]
    assert seqs == sorted(set(seqs))
    faults = Counter((t.verdict, t.reason) for t in fleet.ground_truth if t.verdict != "accept")
    assert {("reject", "bad_signature"), ("reject", "missing_mst_block"), ("ignore", "rev_not_increasing"),
            ("desync", "since_mismatch"), ("ignore", "seq_not_increasing")} <= set(faults)
    assert {"deactivate", "takedown"} <= {t.fault for t in fleet.ground_truth}
    for (verdict, reason), n in faults.items():
        if reason == "seq_not_increasing":  # dropped by the subscriber before any verdict
            continue
        assert metric_sum(metrics, "relay_verdicts_total", kind=verdict, reason=reason) >= n, (verdict, reason)
