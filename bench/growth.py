"""Growth: ingest rate and relay RSS as the number of accounts grows (1k, 10k, 100k).

Each size runs ``bench/ingest.py``'s measurement on a fresh relay (SQLite) with a fleet of that
many accounts (no start-up announcements, so most first commits are also the relay's first sight
of the account: identity resolution and a new account row are part of the cost).

    .venv/bin/python bench/growth.py [--quick] [--sizes 1000,10000,100000] [--commits N] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import note, result  # noqa: E402
from bench.ingest import run_ingest  # noqa: E402
from sim import SimConfig  # noqa: E402


async def run(sizes: list[int], commits: int, profile: str | None = None,
              relay_args: list[str] | None = None) -> None:
    figures = {}
    for n in sizes:
        hosts = 4
        cfg = SimConfig(hosts=hosts, accounts_per_host=n // hosts, seed=3, announce_accounts=False)
        note(f"growth: {n} accounts")
        out = await run_ingest(hosts=hosts, accounts=n // hosts, commits=commits, db="sqlite",
                               prefix=f"growth_{n}", fleet_config=cfg, stall_s=60.0,
                               profile=f"{profile}.{n}" if profile else None, relay_args=relay_args)
        figures[n] = out
    first = sizes[0]
    for n in sizes[1:]:
        result(f"growth_rate_ratio_{n}_vs_{first}",
               figures[n]["commits_per_s_overall"] / figures[first]["commits_per_s_overall"])
        result(f"growth_rss_ratio_{n}_vs_{first}", figures[n]["relay_rss_mb"] / figures[first]["relay_rss_mb"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None)
    p.add_argument("--commits", type=int, default=None)
    p.add_argument("--profile", default=None,
                   help="run the relay's main process under cProfile; stats in PROFILE.<size>")
    p.add_argument("--identity-rate", type=int, default=None,
                   help="the relay's RELAY_IDENTITY_RATE (default: the relay's own, 200/s): raise it to "
                        "measure the CPU of first sight without the politeness cap pacing the commits")
    a = p.parse_args()
    sizes = [int(x) for x in (a.sizes or ("1000,10000" if a.quick else "1000,10000,100000")).split(",")]
    commits = a.commits or (1500 if a.quick else 10_000)
    relay_args = ["--identity-rate", str(a.identity_rate)] if a.identity_rate else None
    asyncio.run(run(sizes, commits, a.profile, relay_args))
    if a.profile:
        import pstats

        for n in sizes:
            print(f"# relay main process at {n} accounts, top functions by cumulative time:", file=sys.stderr)
            pstats.Stats(f"{a.profile}.{n}", stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
