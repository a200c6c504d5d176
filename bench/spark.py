"""Benchmark of the Spark jobs at realistic repository sizes, served over HTTP by the simulator.

    .venv/bin/python bench/spark.py [--hosts 4] [--repos 400] [--min-records 1000]
        [--max-records 10000] [--masters local[1],local[2]] [--partitions 16] [--task-threads 2]
        [--repeat 1] [--read-rows 0]

A fleet of ``--hosts`` simulated PDSes holds ``--repos`` repositories whose sizes are drawn
log-uniformly from ``[min, max]`` records (the simulator's realistic mix of posts, likes,
follows, reposts, profiles…). Each host serves ``getRepo`` as a PDS does: the whole repository as
one CAR over HTTP (the CAR is built once per repository before the clock starts, so the
simulator's own CPU is not what is measured). For each Spark master in ``--masters`` (one
session after another, same fleet, same database) it runs:

* ``resync`` twice (the first is the session's first job: Python workers start, JIT warm-up):
  getRepo, DID resolution from the simulated PLC, full verification (signature, every block
  hash, the whole MST), comparison, batched write-back;
* ``export`` with ``record_format=json`` twice, then once with ``dag-cbor``: the same fetch and
  verification, strict decoding of every record, Parquet files written by the executors.

RESULT lines (``<m>`` = ``local1``, ``local2``…): ``spark_<m>_resync_repos_per_s``,
``spark_<m>_resync_mb_per_s`` (CAR bytes verified), ``spark_<m>_export_json_records_per_s``,
``spark_<m>_export_dagcbor_records_per_s`` (warm runs), the same divided by the master's cores
(``…_per_core``), and for two masters the scaling ``spark_scaling_<figure>`` = second / first.
``--read-rows N`` also measures reading N account rows in DID ranges (asyncpg in the executors
vs Spark's JDBC source: the choice in ``spark.partitioning``).

The bench also runs against older code that has no ``layout`` argument to ``run_export`` (then
only the JSON export is measured). Uses PostgreSQL at $RELAY_TEST_PG_DSN (default
127.0.0.1:5432/test) in a private schema that is dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import math
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg  # noqa: E402

from backfill.backends import open_store  # noqa: E402
from backfill.types import HostState  # noqa: E402
from firehose.state import AccountState  # noqa: E402
from mst.cid import cid_str  # noqa: E402
from spark.config import FetchConfig, JobConfig  # noqa: E402
from spark.db import connect_db, split_schema  # noqa: E402
from spark.relaydb import AccountFilter  # noqa: E402

PG = os.environ.get("RELAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def result(name: str, value: float) -> None:
    print(f"RESULT {name}={value:.2f}", flush=True)


class Fleet:
    """The simulator on a background loop (Spark's Python workers fetch from it over HTTP)."""

    def __init__(self, hosts: int, repos: int, min_records: int, max_records: int, seed: int = 3) -> None:
        from sim import SimConfig, SimFleet

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.fleet = SimFleet(SimConfig(hosts=hosts, accounts_per_host=-(-repos // hosts), seed=seed,
                                        announce_accounts=False))
        self.run(self.fleet.start())
        self.records, self.car_bytes = self.run(self._fill(min_records, max_records, seed))

    async def _fill(self, lo: int, hi: int, seed: int) -> tuple[int, int]:
        """Grow every repository to its drawn size, then freeze its CAR (served as is)."""
        from sim.records import WriteMix

        rng = random.Random(seed)
        mix = WriteMix(rng, other_dids=[a.did for a in self.fleet.accounts[:1000]])
        records = size = 0
        for acct in self.fleet.accounts:
            want = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            have = len(acct.repo.records())
            for start in range(have, want, 5000):
                acct.repo.apply_writes([mix._create() for _ in range(min(5000, want - start))])
            car = acct.repo.export_car()
            acct.repo.export_car = lambda car=car: car  # type: ignore[method-assign]
            records += len(acct.repo.records())
            size += len(car)
            await asyncio.sleep(0)
        return records, size

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(3600)


async def prepare_db(url: str, fleet: Fleet, extra_rows: int) -> None:
    store = await open_store(url)
    try:
        await store.migrate()
        for host in fleet.fleet.hosts:
            await store.upsert_host(HostState(hostname=host.hostname))
        for a in fleet.fleet.accounts:
            await store.upsert_account(AccountState(
                did=a.did, host=a.host.hostname, rev=a.repo.rev, commit_cid=cid_str(a.repo.head),
                data_cid=cid_str(a.repo.data_root)))
    finally:
        await store.close()
    if not extra_rows:
        return
    dsn, schema = split_schema(url)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
    try:  # a separate, larger table with the accounts layout for the read measurement
        await conn.execute("CREATE TABLE read_probe (LIKE accounts INCLUDING ALL)")
        await conn.execute(
            "INSERT INTO read_probe (did, host, rev, commit_cid, data_cid) "
            "SELECT 'did:plc:' || md5(i::text), 'pds' || (i % 50) || '.example', '3k2a', 'bafyc', 'bafyd' "
            "FROM generate_series(1, $1) AS i", extra_rows)
    finally:
        await conn.close()


def measure_reads(spark: Any, url: str, parts: int) -> tuple[float, float, int]:
    """Rows/s reading ``read_probe`` in ``parts`` DID ranges: Python (asyncpg) vs JDBC."""
    with connect_db(url) as db:
        total = int(db.fetchval("SELECT count(*) FROM read_probe"))
        cuts = [db.fetchval("SELECT did FROM read_probe ORDER BY did LIMIT 1 OFFSET ?", total * i // parts)
                for i in range(1, parts)]
    bounds = list(zip([None, *cuts], [*cuts, None], strict=True))

    def read_range(bound: tuple[str | None, str | None]) -> list[tuple]:
        lo, hi = bound
        with connect_db(url) as db:
            sql, args = "SELECT did, host, rev, commit_cid, data_cid, sync_state FROM read_probe WHERE true", []
            if lo:
                sql, args = sql + " AND did >= ?", [*args, lo]
            if hi:
                sql, args = sql + " AND did < ?", [*args, hi]
            return [tuple(r.values()) for r in db.fetch(sql, *args)]

    sc = spark.sparkContext
    t0 = time.perf_counter()
    n_py = sc.parallelize(bounds, len(bounds)).flatMap(read_range).count()
    py_rate = n_py / (time.perf_counter() - t0)

    dsn, schema = split_schema(url)
    rest = dsn.split("://", 1)[1]
    userinfo, _, hostpart = rest.rpartition("@")
    jdbc = f"jdbc:postgresql://{hostpart}" + (f"?currentSchema={schema}" if schema else "")
    predicates = []
    for lo, hi in bounds:
        conds = [f"did >= '{lo}'" if lo else "true", f"did < '{hi}'" if hi else "true"]
        predicates.append(" AND ".join(conds))
    props = {"user": userinfo.split(":")[0] or "postgres", "driver": "org.postgresql.Driver"}
    t0 = time.perf_counter()
    frame = spark.read.jdbc(jdbc, "(SELECT did, host, rev, commit_cid, data_cid, sync_state FROM read_probe) q",
                            predicates=predicates, properties=props)
    n_jdbc = frame.rdd.map(tuple).count()  # rows cross into Python, as the jobs need them
    jdbc_rate = n_jdbc / (time.perf_counter() - t0)
    assert n_py == n_jdbc == total
    return py_rate, jdbc_rate, total


def tree_cpu() -> dict[str, float]:
    """CPU seconds (user + system, including reaped children) used so far by this process (the
    driver and the simulator's thread), its JVM and the JVM's Python workers (everything else
    below this process)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        stats[int(entry)] = (int(fields[1]), comm, sum(int(f) for f in fields[11:15]) / tick)
    me = os.getpid()
    out = {"driver": stats[me][2], "jvm": 0.0, "workers": 0.0}
    frontier = [me]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, comm, cpu) in stats.items():
            if ppid == parent:
                out["jvm" if comm == "java" else "workers"] += cpu
                frontier.append(pid)
    return out


def cpu_note(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in before) + " CPU-s"


def run_totals(url: str, run_id: str) -> tuple[int, int]:
    """(CAR bytes, records) the run's repositories had."""
    with connect_db(url) as db:
        rows = db.fetch("SELECT coalesce(sum(bytes), 0) AS b, coalesce(sum(records), 0) AS r "
                        "FROM spark_job_results WHERE run_id = ?", run_id)
    return int(rows[0]["b"]), int(rows[0]["r"])


def cores_of(master: str) -> int:
    found = re.fullmatch(r"local\[(\d+)\]", master)
    return int(found.group(1)) if found else os.cpu_count() or 1


def bench_master(master: str, args: argparse.Namespace, fleet: Fleet, url: str) -> dict[str, float]:
    """Run every job in one session on ``master``; returns the warm figures."""
    from spark.export import run_export
    from spark.resync import run_resync
    from spark.session import build_session

    tag = master.replace("[", "").replace("]", "").replace("*", "all")
    cores = cores_of(master)
    t0 = time.perf_counter()
    spark = build_session(master, app_name="relay-spark-bench", progress_bar=False, ui=False,
                          shuffle_partitions=cores)
    result(f"spark_{tag}_session_start_s", time.perf_counter() - t0)
    sc = spark.sparkContext
    assert sc.master == master, (sc.master, master)
    print(f"# session: master {sc.master}, {sc.defaultParallelism} task slots", flush=True)
    shards = max(1, -(-args.partitions // args.hosts))
    fetch = FetchConfig(allow_private=True, scheme="http", plc_url=fleet.fleet.plc_url, host_rate=10_000.0,
                        host_concurrency=args.task_threads * shards, retries=1, shards_per_host=shards)
    repos = len(fleet.fleet.accounts)
    figures: dict[str, float] = {}
    has_layout = "layout" in inspect.signature(run_export).parameters

    def job_config() -> JobConfig:
        return JobConfig(db_url=url, run_id=f"bench-{uuid.uuid4().hex[:6]}", fetch=fetch,
                         partitions=args.partitions, write_batch=50)

    try:
        for name, times in (("resync_cold", 1), ("resync", args.repeat)) if "resync" in args.jobs else ():
            rates: list[tuple[float, float, float]] = []
            for _ in range(times):
                cfg = job_config()
                c0, t0 = tree_cpu(), time.perf_counter()
                summary = run_resync(spark, cfg, AccountFilter())
                elapsed, c1 = time.perf_counter() - t0, tree_cpu()
                assert summary["totals"] == {"ok": repos}, summary
                size, records = run_totals(url, cfg.run_id)
                print(f"# {master} {name}: {repos} repositories, {records} records, {size / 1e6:.1f} MB "
                      f"in {elapsed:.2f}s; {cpu_note(c0, c1)}", flush=True)
                rates.append((repos / elapsed, size / 1e6 / elapsed,
                              repos / max(1e-9, c1["workers"] - c0["workers"])))
            repos_rate, mb_rate, per_cpu = (statistics.median(r[i] for r in rates) for i in range(3))
            result(f"spark_{tag}_{name}_repos_per_s", repos_rate)
            result(f"spark_{tag}_{name}_mb_per_s", mb_rate)
            result(f"spark_{tag}_{name}_repos_per_worker_cpu_s", per_cpu)
            figures[f"{name}_repos_per_s"] = repos_rate
            figures[f"{name}_mb_per_s"] = mb_rate

        runs = [("export_json_cold", "json"), ("export_json", "json")] if "export_json" in args.jobs else []
        if has_layout and "export_dagcbor" in args.jobs:
            runs.append(("export_dagcbor", "dag-cbor"))
        for name, fmt in runs:
            rates = []
            for _ in range(1 if name.endswith("cold") else args.repeat):
                with tempfile.TemporaryDirectory(dir=args.out_parent) as out:
                    cfg = job_config()
                    extra: dict[str, Any] = {}
                    if has_layout:
                        from spark.records_out import ParquetLayout

                        extra["layout"] = ParquetLayout(record_format=fmt)
                    c0, t0 = tree_cpu(), time.perf_counter()
                    manifest = run_export(spark, cfg, AccountFilter(), out, **extra)
                    elapsed, c1 = time.perf_counter() - t0, tree_cpu()
                    files = sorted(Path(out, "records").rglob("*.parquet"))
                    on_disk = sum(p.stat().st_size for p in files)
                assert manifest["failed"] == {}, manifest["failed"]
                assert manifest["records"] == fleet.records, (manifest["records"], fleet.records)
                print(f"# {master} {name}: {manifest['records']} records from {repos} repositories in "
                      f"{elapsed:.2f}s; {cpu_note(c0, c1)}; Parquet {on_disk / 1e6:.1f} MB in {len(files)} files "
                      f"({files[0].name}…)", flush=True)
                rates.append((manifest["records"] / elapsed,
                              manifest["records"] / max(1e-9, c1["workers"] - c0["workers"]), 0.0))
            rate, per_cpu = (statistics.median(r[i] for r in rates) for i in range(2))
            result(f"spark_{tag}_{name}_records_per_worker_cpu_s", per_cpu)
            result(f"spark_{tag}_{name}_records_per_s", rate)
            figures[f"{name}_records_per_s"] = rate

        for key in ("resync_repos_per_s", "resync_mb_per_s", "export_json_records_per_s",
                    "export_dagcbor_records_per_s"):
            if key in figures:
                result(f"spark_{tag}_{key.replace('_per_s', '')}_per_s_per_core", figures[key] / cores)

        if args.read_rows:
            py_rate, jdbc_rate, rows = measure_reads(spark, url, 4)
            print(f"# accounts read: {rows} rows in 4 partitions", flush=True)
            result(f"spark_{tag}_accounts_read_python_rows_per_s", py_rate)
            result(f"spark_{tag}_accounts_read_jdbc_rows_per_s", jdbc_rate)
    finally:
        spark.stop()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--repos", type=int, default=400, help="repositories in all (spread over the hosts)")
    parser.add_argument("--min-records", type=int, default=1000)
    parser.add_argument("--max-records", type=int, default=10_000)
    parser.add_argument("--masters", default="local[1],local[2]", help="comma-separated Spark masters")
    parser.add_argument("--partitions", type=int, default=16, help="tasks per job (same for every master)")
    parser.add_argument("--jobs", default="resync,export_json,export_dagcbor",
                        help="which of resync, export_json, export_dagcbor to run")
    parser.add_argument("--repeat", type=int, default=1, help="warm runs of each job (the median is reported)")
    parser.add_argument("--task-threads", type=int, default=2, help="fetching threads per task")
    parser.add_argument("--read-rows", type=int, default=0, help="also measure reading this many account rows")
    parser.add_argument("--out-parent", default=None, help="where the export's temporary output goes")
    args = parser.parse_args()

    t0 = time.perf_counter()
    fleet = Fleet(args.hosts, args.repos, args.min_records, args.max_records)
    print(f"# fleet: {len(fleet.fleet.accounts)} repositories on {args.hosts} hosts, {fleet.records} records, "
          f"{fleet.car_bytes / 1e6:.1f} MB of CAR ({fleet.car_bytes / max(1, fleet.records):.0f} B/record); "
          f"built in {time.perf_counter() - t0:.1f}s", flush=True)
    schema = f"bench_spark_{uuid.uuid4().hex[:8]}"
    url = f"{PG}?schema={schema}"
    asyncio.run(prepare_db(url, fleet, args.read_rows))
    all_figures: list[tuple[str, dict[str, float]]] = []
    try:
        for master in args.masters.split(","):
            all_figures.append((master, bench_master(master.strip(), args, fleet, url)))
        if len(all_figures) == 2:
            (_, one), (_, two) = all_figures
            for key in sorted(set(one) & set(two)):
                if "cold" not in key:
                    result(f"spark_scaling_{key.replace('_per_s', '')}", two[key] / one[key])
    finally:
        fleet.run(fleet.fleet.stop())

        async def drop() -> None:
            conn = await asyncpg.connect(PG)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()

        asyncio.run(drop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
