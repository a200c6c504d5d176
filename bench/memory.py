"""Memory: relay RSS over time at a steady event rate with one stalled and one slow consumer.

The simulator produces commits live at ``--rate`` (default 1,000/s) for ``--seconds`` (600 for the
full run, 45 with ``--quick``); the relay (child process, SQLite) serves three consumers: a normal
one, a slow one (sleeps ``--slow-delay`` after each frame) and a stalled one (connects, never
reads). RSS of the relay's process tree is sampled every second; after a warm-up of a quarter of
the run it should stay flat (target ±10 %). A stalled consumer must be cut off (ConsumerTooSlow)
instead of growing the relay's memory.

    .venv/bin/python bench/memory.py [--quick] [--seconds S] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import CountingConsumer, load_average, metric_sum, note, relay, result  # noqa: E402
from sim import SimConfig, SimFleet  # noqa: E402


async def run(seconds: float, rate: float, slow_delay: float, *, stalled_on: bool = True,
              slow_on: bool = True) -> None:
    fleet = SimFleet(SimConfig(hosts=4, accounts_per_host=100, seed=4))
    await fleet.start()
    samples: list[tuple[float, int]] = []
    try:
        async with relay(fleet.plc_url) as r:
            normal = CountingConsumer(r.ws_url).start()
            slow = CountingConsumer(r.ws_url, read_delay=slow_delay)
            stalled = CountingConsumer(r.ws_url, stalled=True)
            clients = [normal] + ([slow.start()] if slow_on else []) + ([stalled.start()] if stalled_on else [])
            for c in clients:
                await asyncio.wait_for(c.connected.wait(), 30)
            await r.crawl([h.hostname for h in fleet.hosts])
            producer = asyncio.create_task(fleet.run(rate, seconds))
            t0 = time.monotonic()
            stalled_cut = None
            while not producer.done():
                samples.append((time.monotonic() - t0, r.rss()))
                if stalled_cut is None and stalled._task is not None and stalled._task.done():
                    stalled_cut = time.monotonic() - t0
                await asyncio.sleep(1.0)
            made = await producer
            normal_commits = normal.commits
            # A consumer that never reads cannot see its own disconnect (its socket is not read):
            # the relay's own counters say whether it was cut off.
            text = await r.metrics()
            relay_cut = metric_sum(text, "relay_broadcast_events_total", event="too_slow")
            consumers_left = metric_sum(text, "relay_consumers")
            for c in clients:
                await c.stop()
    finally:
        await fleet.stop()
    rss = [s[1] / 1e6 for s in samples]
    after = [v for (t, _), v in zip(samples, rss, strict=True) if t >= seconds / 4] or rss
    quarter = max(1, len(after) // 3)
    early, late = statistics.mean(after[:quarter]), statistics.mean(after[-quarter:])
    result("memory_seconds", seconds)
    result("memory_input_rate", made / seconds)
    result("memory_delivered_rate_normal_consumer", normal_commits / seconds)
    result("memory_rss_start_mb", rss[0] if rss else float("nan"))
    result("memory_rss_after_warmup_min_mb", min(after))
    result("memory_rss_after_warmup_max_mb", max(after))
    result("memory_rss_spread_pct", 100 * (max(after) - min(after)) / statistics.median(after))
    result("memory_rss_drift_pct", 100 * (late - early) / early)
    if stalled_on:
        result("memory_stalled_consumer_cut_after_s", stalled_cut if stalled_cut is not None else "never")
        result("memory_stalled_consumer_end", stalled.closed_reason or "still_connected")
        result("memory_relay_consumers_cut_too_slow", relay_cut)
        result("memory_relay_consumers_connected_at_end", consumers_left)
    if slow_on:
        result("memory_slow_consumer_frames", slow.frames)
        result("memory_slow_consumer_end", slow.closed_reason or "still_connected")
    result("memory_load_average", load_average())
    note("memory: rss samples (s, MB): " + " ".join(f"{t:.0f}:{v:.0f}" for (t, _), v in zip(samples, rss, strict=True)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--slow-delay", type=float, default=0.005)
    p.add_argument("--no-stalled", action="store_true", help="leave out the stalled consumer (control run)")
    p.add_argument("--no-slow", action="store_true", help="leave out the slow consumer (control run)")
    a = p.parse_args()
    seconds = a.seconds or (30.0 if a.quick else 600.0)
    asyncio.run(run(seconds, a.rate, a.slow_delay, stalled_on=not a.no_stalled, slow_on=not a.no_slow))
    return 0


if __name__ == "__main__":
    sys.exit(main())
