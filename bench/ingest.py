"""Ingest: highest sustained rate of fully verified commits through the whole relay.

Simulator (this process, frames pre-generated) → ``relay serve`` (child process, SQLite by
default, ``--db postgres`` for PostgreSQL) → one consumer (this process). All pre-generated
commits are released at once; the relay pulls them as fast as it can verify, sequence, persist
and broadcast them. The sustained rate is measured between 10 % and 90 % of the delivered
commits; CPU is read from ``/proc`` for the relay's main process and its validation workers;
``main_ceiling_commits_per_s`` (commits per CPU-second of the main process) is the projected
one-process ceiling, reached when the validation workers have cores of their own.

    .venv/bin/python bench/ingest.py [--quick] [--commits N] [--db sqlite|postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PG_DSN,
    CountingConsumer,
    cpu_seconds,
    load_average,
    metric_sum,
    note,
    relay,
    result,
    self_cpu,
    wait_until,
)
from sim import SimConfig, SimFleet  # noqa: E402


async def run_ingest(*, hosts: int, accounts: int, commits: int, db: str, prefix: str = "ingest",
                     workers: int | None = None, fleet_config: SimConfig | None = None,
                     profile: str | None = None, stall_s: float = 20.0,
                     relay_args: list[str] | None = None, rate: float | None = None,
                     quiet: bool = False) -> dict[str, float]:
    """One ingest measurement; returns the figures (also printed as RESULT lines unless ``quiet``).
    ``relay_args`` are extra ``relay serve`` options; ``rate``: release the commits at this many per
    second (all at once when None)."""
    cfg = fleet_config or SimConfig(hosts=hosts, accounts_per_host=accounts, seed=1)
    fleet = SimFleet(cfg)
    t = time.perf_counter()
    await fleet.start()
    n_accounts = len(fleet.accounts)
    note(f"{prefix}: fleet of {hosts} hosts x {accounts} accounts up in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    fleet.prepare(commits)
    gen = time.perf_counter() - t
    note(f"{prefix}: pre-generated {commits} commits in {gen:.1f}s ({commits / gen:.0f}/s)")
    out: dict[str, float] = {"sim_pregen_commits_per_s": commits / gen}
    database_url = None
    if db == "postgres":
        schema = f"bench_{prefix}_{int(time.time())}"
        database_url = f"{PG_DSN}?schema={schema}"
    extra = ([] if workers is None else ["--validation-workers", str(workers)]) + (relay_args or [])
    # a profile covers the measured window only: from the release of the commits to the end
    env = {"RELAY_PROFILE_ON_SIGNAL": "1"} if profile else None
    try:
        async with relay(fleet.plc_url, database_url=database_url, extra=extra, profile=profile, env=env) as r:
            consumer = CountingConsumer(r.ws_url).start()
            await asyncio.wait_for(consumer.connected.wait(), 30)
            await r.crawl([h.hostname for h in fleet.hosts])
            announced = cfg.announce_accounts
            if announced:
                ok = await wait_until(lambda: consumer.commits >= n_accounts, 60 + n_accounts / 200)
                note(f"{prefix}: announcements delivered={consumer.commits}/{n_accounts} ok={ok}")
            else:
                await asyncio.sleep(1.0)
            base = consumer.commits
            expected = sum(1 for tr in fleet.ground_truth[-fleet.pending:] if tr.kind == "#commit"
                           and tr.verdict == "accept") if fleet.pending else 0
            samples: list[tuple[float, int, float, float]] = []
            main_pid = r.proc.pid
            pids = r.refresh_pids()
            workers_pids = [p for p in pids if p != main_pid]
            cpu_main0, cpu_workers0, sim0 = cpu_seconds([main_pid]), cpu_seconds(workers_pids), self_cpu()
            t0 = time.time()
            if profile:
                os.kill(main_pid, signal.SIGUSR1)
            release = asyncio.create_task(fleet.release(rate))
            last_progress = time.monotonic()
            last_n = 0
            while True:
                await asyncio.sleep(0.05)  # fine enough for a --quick run of ~1 s to have a steady span
                n = consumer.commits - base
                samples.append((time.time(), n, r.cpu(), self_cpu()))
                if n != last_n:
                    last_n, last_progress = n, time.monotonic()
                if n >= expected or (release.done() and time.monotonic() - last_progress > stall_s):
                    break
            await release
            t_end = consumer.last_at
            cpu_main = cpu_seconds([main_pid]) - cpu_main0
            cpu_workers = cpu_seconds(workers_pids) - cpu_workers0
            sim_cpu = self_cpu() - sim0
            delivered = consumer.commits - base
            rss = r.rss()
            metrics = await r.metrics()
            await consumer.stop()
    finally:
        await fleet.stop()
    wall = max(1e-9, t_end - t0)
    lo = next((s for s in samples if s[1] >= 0.1 * delivered), samples[0])
    hi = next((s for s in samples if s[1] >= 0.9 * delivered), samples[-1])
    if hi[0] - lo[0] < 0.2:  # too short to tell a steady state from the ramps: whole-run figures
        steady = delivered / wall
        steady_cpu = (cpu_main + cpu_workers) / wall
    else:
        steady = (hi[1] - lo[1]) / (hi[0] - lo[0])
        steady_cpu = (hi[2] - lo[2]) / (hi[0] - lo[0])
    out.update({
        "commits_expected": expected,
        "commits_delivered": delivered,
        "commits_per_s": steady,
        "commits_per_s_overall": delivered / wall,
        "relay_cpu_cores": steady_cpu,
        "relay_cpu_ms_per_commit": 1000 * (cpu_main + cpu_workers) / max(1, delivered),
        "relay_cpu_main_s": cpu_main,
        "relay_cpu_main_ms_per_commit": 1000 * cpu_main / max(1, delivered),
        # the projected one-process ceiling: commits/s when the workers have cores of their own
        "main_ceiling_commits_per_s": delivered / max(1e-9, cpu_main),
        "relay_cpu_workers_s": cpu_workers,
        "sim_and_consumer_cpu_s": sim_cpu,
        "seconds": wall,
        "relay_rss_mb": rss / 1e6,
        "rejects": metric_sum(metrics, "relay_verdicts_total", kind="reject"),
        "load_average": load_average(),
    })
    if not quiet:
        for k, v in out.items():
            result(f"{prefix}_{k}", v)
    return out


async def sim_capacity(commits: int, hosts: int = 4) -> float:
    """Frames/s the simulator pushes to plain consumers (one per host) from pre-generated commits."""
    from bench._rawws import subscribe

    fleet = SimFleet(SimConfig(hosts=hosts, accounts_per_host=100, seed=9, announce_accounts=False))
    await fleet.start()
    try:
        fleet.prepare(commits)
        stop = asyncio.Event()
        got = [0]
        connected = [0]

        def on_message(msg: bytes, t: float) -> None:
            got[0] += 1
            if got[0] >= commits:
                stop.set()

        tasks = [asyncio.create_task(subscribe(h.url.replace("http", "ws") + "/xrpc/com.atproto.sync.subscribeRepos",
                                               on_message, stop=stop,
                                               connected=lambda: connected.__setitem__(0, connected[0] + 1)))
                 for h in fleet.hosts]
        await wait_until(lambda: connected[0] == hosts and all(h.subscriber_count for h in fleet.hosts), 30, 0.01)
        t0 = time.perf_counter()
        await fleet.release(None)
        await asyncio.wait_for(stop.wait(), 120)
        rate = commits / (time.perf_counter() - t0)
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await fleet.stop()
    result("sim_frames_per_s", rate)
    return rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--commits", type=int, default=None)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--accounts", type=int, default=250, help="accounts per host")
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--workers", type=int, default=None, help="relay --validation-workers")
    p.add_argument("--skip-sim-capacity", action="store_true")
    p.add_argument("--rate", type=float, default=None, help="release the commits at this rate (default: all at once)")
    p.add_argument("--profile", default=None, help="profile the relay's main process over the measured window (cProfile, CPU clock), stats here")
    a = p.parse_args()
    if not a.skip_sim_capacity:
        asyncio.run(sim_capacity(5_000 if a.quick else 20_000))
    commits = a.commits or (8_000 if a.quick else 60_000)
    asyncio.run(run_ingest(hosts=a.hosts, accounts=a.accounts, commits=commits, db=a.db, workers=a.workers,
                           profile=a.profile, rate=a.rate))
    if a.profile:
        import pstats

        print("# relay main process, top functions by own time:", file=sys.stderr)
        pstats.Stats(a.profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
