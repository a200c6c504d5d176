"""Many hosts against few: does following 1,000 hosts cost the relay more per commit than 3?

The same commits (``--commits`` over ``--accounts`` accounts) come once from ``--few`` hosts and
once from ``--many`` hosts (the accounts split evenly), released at the same ``--rate`` commits
per second, through ``bench/ingest.py``'s measurement (simulator and consumer in this process,
``relay serve`` a child). Runs alternate few, many, few, many… (``--pairs`` pairs), so each pair
sees nearly the same machine load.

The figure is the relay's CPU per delivered commit (main process plus validation workers, from
``/proc``): on a machine too loaded to give the relay its own cores, commits/s measures the
harness, while CPU per commit is what each commit costs the relay. ``rate_ratio`` = CPU per commit
with few hosts / with many hosts: the ingest rate at many hosts relative to few at the same
machine share (1.0 = no per-host cost; the target is ≥ 0.9). Printed as ``RESULT
hosts_ingest_<name>=<value>``: per pair ``pair<i>_rate_ratio`` and ``pair<i>_main_ratio`` (main
process only), their medians, each side's ``cpu_ms_per_commit`` medians and the commits delivered.

    .venv/bin/python bench/hosts_ingest.py                  # 3 against 1,000 hosts, 3,000 accounts
    .venv/bin/python bench/hosts_ingest.py --many 100 --commits 2000 --pairs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import load_average, note, result  # noqa: E402
from bench.ingest import run_ingest  # noqa: E402


async def run(a: argparse.Namespace) -> None:
    sides = {"few": a.few, "many": a.many}
    got: dict[str, list[dict[str, float]]] = {"few": [], "many": []}
    for i in range(a.pairs):
        for side, hosts in sides.items():
            out = await run_ingest(hosts=hosts, accounts=max(1, a.accounts // hosts), commits=a.commits, db=a.db,
                                   prefix=f"hosts_ingest_{side}", rate=a.rate, stall_s=a.stall, quiet=True)
            got[side].append(out)
            note(f"hosts_ingest: pair {i} {side} ({hosts} hosts): {out['commits_delivered']:.0f}/"
                 f"{out['commits_expected']:.0f} commits, {out['relay_cpu_ms_per_commit']:.3f} ms CPU per commit "
                 f"(main {out['relay_cpu_main_ms_per_commit']:.3f}), load {load_average():.1f}")
    ratios, main_ratios = [], []
    for i, (few, many) in enumerate(zip(got["few"], got["many"], strict=True)):
        ratios.append(few["relay_cpu_ms_per_commit"] / many["relay_cpu_ms_per_commit"])
        main_ratios.append(few["relay_cpu_main_ms_per_commit"] / many["relay_cpu_main_ms_per_commit"])
        result(f"hosts_ingest_pair{i}_rate_ratio", round(ratios[-1], 3))
        result(f"hosts_ingest_pair{i}_main_ratio", round(main_ratios[-1], 3))
    result("hosts_ingest_rate_ratio_median", round(statistics.median(ratios), 3))
    result("hosts_ingest_main_ratio_median", round(statistics.median(main_ratios), 3))
    for side, hosts in sides.items():
        runs = got[side]
        result(f"hosts_ingest_{side}_hosts", hosts)
        result(f"hosts_ingest_{side}_cpu_ms_per_commit_median",
               round(statistics.median(r["relay_cpu_ms_per_commit"] for r in runs), 4))
        result(f"hosts_ingest_{side}_main_cpu_ms_per_commit_median",
               round(statistics.median(r["relay_cpu_main_ms_per_commit"] for r in runs), 4))
        result(f"hosts_ingest_{side}_commits_delivered_min", min(r["commits_delivered"] for r in runs))
        result(f"hosts_ingest_{side}_commits_per_s_median", round(statistics.median(r["commits_per_s"] for r in runs), 1))
    result("hosts_ingest_commits", a.commits)
    result("hosts_ingest_rate", a.rate)
    result("hosts_ingest_load_average", load_average())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--few", type=int, default=3)
    p.add_argument("--many", type=int, default=1000)
    p.add_argument("--accounts", type=int, default=3000, help="accounts in all, split evenly over the hosts")
    p.add_argument("--commits", type=int, default=12_000)
    p.add_argument("--rate", type=float, default=300.0, help="commits released per second (both sides)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--stall", type=float, default=60.0, help="give up when nothing is delivered this long")
    asyncio.run(run(p.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
