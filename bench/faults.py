"""Fault injection as figures: runs the scenarios of ``tests/faults`` (same harness, same rig) and
prints, for each, ``RESULT faults_<scenario>_<figure>=<value>`` lines:

* ``lost`` – accepted commits of the ground truth never delivered as ``#commit`` (summed over the
  scenario's consumers: one for ``relay serve``, one per fan-out process in scale-out);
* ``duplicates`` – frames delivered twice (same seq) plus commits delivered twice;
* ``converted_to_sync`` – accounts that received a ``#sync`` their host never sent (a repair
  instead of the commits);
* ``resume_s`` – seconds from the dependency's return until every consumer has received, for the
  accounts of every host, an event sequenced after that return (the slowest consumer/host pair;
  ``inf``: never, within the bounded wait);
* ``accounts_in_sync`` – accounts whose rev, in the relay's state and in every consumer's stream,
  is the one their host holds (out of ``accounts``);
* also ``rev_order_violations``, ``relays_alive``, ``readiness_violations``, ``expected_commits``,
  ``outage_s``, ``scenario_s``, and ``violations`` (how many promises the scenario broke).

Usage: ``.venv/bin/python bench/faults.py [SCENARIO ...] [--rate R] [--pg-down-outage S] [--report]``
(default: every scenario; names: pg_kill, pg_fast_restart, pg_down, redis_kill, relay_kill,
upstream_storm, ingest_kill_unpublished, spark_behind). Needs PostgreSQL server binaries and redis-server on the machine, not running
servers: every scenario starts its own. Exit status 0 even when promises are broken (it measures;
``tests/faults`` is the judge).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench._common, tests.faults

from bench._common import load_average, note, result  # noqa: E402
from tests.faults.scenarios import SCENARIOS, Settings, run_named  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/faults.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help=f"scenarios to run (default: all of {', '.join(SCENARIOS)})")
    defaults = Settings()
    parser.add_argument("--rate", type=float, default=defaults.rate, help="commits/s during the fault")
    parser.add_argument("--pg-kill-outage", type=float, default=defaults.pg_kill_outage)
    parser.add_argument("--pg-down-outage", type=float, default=defaults.pg_down_outage)
    parser.add_argument("--redis-outage", type=float, default=defaults.redis_outage)
    parser.add_argument("--catch-up-timeout", type=float, default=defaults.catch_up_timeout)
    parser.add_argument("--report", action="store_true", help="print each scenario's full report to stderr")
    ns = parser.parse_args(argv)
    unknown = [n for n in ns.scenarios if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return ns


async def main_async(ns: argparse.Namespace) -> int:
    settings = dataclasses.replace(Settings(), rate=ns.rate, pg_kill_outage=ns.pg_kill_outage,
                                   pg_down_outage=ns.pg_down_outage, redis_outage=ns.redis_outage,
                                   catch_up_timeout=ns.catch_up_timeout)
    names = ns.scenarios or list(SCENARIOS)
    t0 = time.monotonic()
    for name in names:
        note(f"faults: {name} (load {load_average():.2f})")
        outcome = await run_named(name, settings)
        for key, value in outcome.results().items():
            result(f"faults_{name}_{key}", value)
        result(f"faults_{name}_violations", len(outcome.violations()))
        if ns.report:
            note(outcome.render())
    result("faults_bench_seconds", round(time.monotonic() - t0, 1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
