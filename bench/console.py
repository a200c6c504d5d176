"""Operator console: what its host table and its per-process report cost with many hosts.

A relay (``serve`` role, SQLite in a temporary directory) holding ``--hosts`` stored hosts, each
with a ``relay_events_in_total`` series (as if each had sent frames) and a rejected frame in the
per-host ledger. Measured in this process, through the app (no network):

* ``console_hosts_cold_ms``: ``/dashboard/api/hosts`` right after the host index expired (every
  host read from the store, joined, sorted, one page cut);
* ``console_hosts_warm_ms``: the same within the index's 2 s (median of 20), sorted by rate, with
  a search;
* ``…_cpu_ms``: the CPU time of this process for the same (all threads; wall time on a loaded
  machine says little);
* ``console_report_ms``: one collection of the process's report (median of 10), and
  ``console_report_bytes``, its JSON size (what a process writes to Redis every 2 s in scale-out).

    .venv/bin/python bench/console.py [--hosts N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from backfill.types import HostState  # noqa: E402
from bench._common import load_average, note, result  # noqa: E402
from relay.config import RelayConfig  # noqa: E402
from relay.service import RelayService  # noqa: E402


async def run(hosts: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = RelayConfig.from_values({"database_url": f"{tmp}/relay.sqlite", "bind": "127.0.0.1:0",
                                          "validation_workers": "0"})
        service = RelayService(config)
        await service.start()
        try:
            for i in range(hosts):
                name = f"pds{i:06d}.bench.example"
                await service.store.upsert_host(HostState(hostname=name, status="active", account_count=i % 50,
                                                          created_at=1.0))
                service.metrics.host_series.count_in(name, "#commit", i % 997)
                service.host_ledger.count(name, "reject", "bad_signature")
            assert service.app is not None
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
                await service.reporter.publish()  # the loop's report, as every 2 s
                service.console_hosts.invalidate()
                cpu = time.process_time()
                started = time.perf_counter()
                r = await http.get("/dashboard/api/hosts", params={"sort": "rate", "order": "desc"})
                cold = (time.perf_counter() - started) * 1000
                cold_cpu = (time.process_time() - cpu) * 1000
                assert r.status_code == 200 and r.json()["total"] == hosts, r.text
                warm = []
                cpu = time.process_time()
                for _ in range(20):
                    started = time.perf_counter()
                    r = await http.get("/dashboard/api/hosts", params={"sort": "rate", "order": "desc", "q": "0"})
                    warm.append((time.perf_counter() - started) * 1000)
                    assert r.status_code == 200
                warm_cpu = (time.process_time() - cpu) * 1000 / 20
            collect = []
            cpu = time.process_time()
            for _ in range(10):
                started = time.perf_counter()
                report = await service.reporter.collect()
                collect.append((time.perf_counter() - started) * 1000)
            collect_cpu = (time.process_time() - cpu) * 1000 / 10
        finally:
            await service.stop()
    note(f"{hosts} hosts, load average {load_average():.1f}")
    result("console_hosts_cold_ms", round(cold, 1))
    result("console_hosts_cold_cpu_ms", round(cold_cpu, 1))
    result("console_hosts_warm_ms", round(statistics.median(warm), 1))
    result("console_hosts_warm_cpu_ms", round(warm_cpu, 1))
    result("console_report_ms", round(statistics.median(collect), 1))
    result("console_report_cpu_ms", round(collect_cpu, 1))
    result("console_report_bytes", len(json.dumps(report)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=10_000)
    asyncio.run(run(p.parse_args().hosts))


if __name__ == "__main__":
    main()
