"""Benchmark of the Spark jobs in ``local[2]`` against the PDS-fleet simulator.

    .venv/bin/python bench/spark.py [--hosts 4] [--accounts 100] [--records 25] [--read-rows 200000]

Prints ``RESULT <name>=<value>`` lines:

* ``spark_session_start_s``         — SparkSession start (C1-only JVM), not part of any job figure;
* ``resync_cold_repos_per_s``       — full resync (getRepo, DID resolution, full verification,
                                      write-back) of every repository as the session's first job;
* ``resync_repos_per_s``            — the same job again in the warm session (fresh run id, so
                                      every repository is fetched and verified again);
* ``export_cold_records_per_s``     — export of every record to Parquet as the session's first
                                      DataFrame job (Spark SQL warm-up included);
* ``export_records_per_s``          — the same export again (fetch + verify + Parquet write);
* ``accounts_read_python_rows_per_s`` / ``accounts_read_jdbc_rows_per_s`` — reading the accounts
  table in parallel DID ranges: asyncpg inside the executors vs Spark's JDBC source with the
  Debian PostgreSQL driver (the measurement behind the choice in ``spark.partitioning``).

Uses PostgreSQL at $RELAY_TEST_PG_DSN (default 127.0.0.1:5432/test) in a private schema that is
dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg  # noqa: E402

from backfill.store import open_store  # noqa: E402
from firehose.state import AccountState, HostState  # noqa: E402
from mst.cid import cid_str  # noqa: E402
from spark.config import FetchConfig, JobConfig  # noqa: E402
from spark.db import split_schema  # noqa: E402
from spark.relaydb import AccountFilter  # noqa: E402

PG = os.environ.get("RELAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def result(name: str, value: float) -> None:
    print(f"RESULT {name}={value:.1f}", flush=True)


class Fleet:
    """The simulator on a background loop (Spark's Python workers fetch from it over HTTP)."""

    def __init__(self, hosts: int, accounts: int, records: int) -> None:
        from relay.sim import SimConfig, SimFleet

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.fleet = SimFleet(SimConfig(hosts=hosts, accounts_per_host=accounts, seed=3,
                                        initial_records=records, announce_accounts=False))
        self.run(self.fleet.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)


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
    from spark.db import connect_db

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--accounts", type=int, default=100, help="accounts per host")
    parser.add_argument("--records", type=int, default=25, help="records per repository")
    parser.add_argument("--read-rows", type=int, default=200_000)
    args = parser.parse_args()

    from spark.export import run_export
    from spark.resync import run_resync
    from spark.session import build_session

    fleet = Fleet(args.hosts, args.accounts, args.records)
    schema = f"bench_spark_{uuid.uuid4().hex[:8]}"
    url = f"{PG}?schema={schema}"
    asyncio.run(prepare_db(url, fleet, args.read_rows))
    t0 = time.perf_counter()
    spark = build_session("local[2]", app_name="relay-spark-bench", progress_bar=False, ui=False,
                          shuffle_partitions=2)
    result("spark_session_start_s", time.perf_counter() - t0)
    fetch = FetchConfig(allow_private=True, scheme="http", plc_url=fleet.fleet.plc_url, host_rate=1000.0,
                        host_concurrency=4, retries=1)
    try:
        repos = len(fleet.fleet.accounts)
        for name in ("resync_cold_repos_per_s", "resync_repos_per_s"):
            # the first job of a session also pays for JVM warm-up and Python worker start
            cfg = JobConfig(db_url=url, run_id=f"bench-{uuid.uuid4().hex[:6]}", fetch=fetch, partitions=4)
            t0 = time.perf_counter()
            summary = run_resync(spark, cfg, AccountFilter())
            elapsed = time.perf_counter() - t0
            assert summary["totals"] == {"ok": repos}, summary
            print(f"# {name}: {repos} repositories in {elapsed:.2f}s", flush=True)
            result(name, repos / elapsed)

        for name in ("export_cold_records_per_s", "export_records_per_s"):
            # the first DataFrame/Parquet job of a session also pays for Spark SQL's warm-up
            with tempfile.TemporaryDirectory() as out:
                cfg = JobConfig(db_url=url, run_id=f"bench-{uuid.uuid4().hex[:6]}", fetch=fetch, partitions=4)
                t0 = time.perf_counter()
                manifest = run_export(spark, cfg, AccountFilter(), out)
                elapsed = time.perf_counter() - t0
            assert manifest["failed"] == {}, manifest["failed"]
            print(f"# {name}: {manifest['records']} records from {repos} repositories in {elapsed:.2f}s",
                  flush=True)
            result(name, manifest["records"] / elapsed)

        py_rate, jdbc_rate, rows = measure_reads(spark, url, 4)
        print(f"# accounts read: {rows} rows in 4 partitions", flush=True)
        result("accounts_read_python_rows_per_s", py_rate)
        result("accounts_read_jdbc_rows_per_s", jdbc_rate)
    finally:
        spark.stop()
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
