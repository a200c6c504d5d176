"""``com.atproto.sync.listReposByCollection`` latency with 100,000 accounts in the store, on SQLite
and PostgreSQL (target: p99 < 10 ms).

Set-up per backend (a file in a temp dir, or a fresh schema on the shared Postgres, dropped after):
the relay's migrations, then a bulk load of ``--accounts`` accounts (3 % not active: taken down
locally, deactivated or suspended upstream) and their ``repo_collections`` rows, each account in
each collection with a Bluesky-like probability (profile 95 %, follow 90 %, like 85 %, post 75 %,
repost 50 %, block 15 %, list 5 %, feed generator 0.5 %, a rare one 0.05 %): ~4.3 rows per account.

Measured, ``--queries`` calls each, sequentially, the mix of what a backfilling consumer asks:
every collection in turn, half first pages and half pages after a random cursor (a random DID),
limits 100 / 500 (the default) / 2,000 (the maximum):

* ``rbc_<b>_store_p50_ms`` / ``_p99_ms`` / ``_max_ms``: ``Store.list_repos_by_collection`` in this process;
  ``rbc_<b>_store_cpu_p50_ms`` / ``_p99_ms``: the CPU time of each call (this process, plus the
  Postgres backend's from ``/proc/<pid>/schedstat`` for the same SQL on one connection), which a
  loaded machine does not inflate;
* ``rbc_<b>_http_p50_ms`` / ``_p99_ms``: ``GET /xrpc/com.atproto.sync.listReposByCollection`` of a
  ``relay serve`` child on the same database (client-side time, keep-alive connection);
* ``rbc_<b>_walk_pages`` / ``rbc_<b>_walk_seconds``: paging through the biggest collection at the
  maximum limit;
* the query plan is printed (stderr) for review.

    .venv/bin/python bench/repos_by_collection.py [--backend sqlite|postgres|both]
                                                  [--accounts 100000] [--queries 3000] [--no-http]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backfill.backends import open_store  # noqa: E402
from backfill.store import Store  # noqa: E402
from bench._common import PG_DSN, load_average, note, relay, result  # noqa: E402

COLLECTIONS: dict[str, float] = {
    "app.bsky.actor.profile": 0.95,
    "app.bsky.graph.follow": 0.90,
    "app.bsky.feed.like": 0.85,
    "app.bsky.feed.post": 0.75,
    "app.bsky.feed.repost": 0.50,
    "app.bsky.graph.block": 0.15,
    "app.bsky.graph.list": 0.05,
    "app.bsky.feed.generator": 0.005,
    "com.example.rare.thing": 0.0005,
}
STATUSES = [("active", "active")] * 97 + [("active", "takendown"), ("deactivated", "active"), ("suspended", "active")]
LIMITS = (100, 500, 2000)
_B32 = "abcdefghijklmnopqrstuvwxyz234567"


def make_data(n: int, seed: int = 15) -> tuple[list[tuple[object, ...]], list[tuple[str, str, int]]]:
    """Account rows ``(did, host, upstream_status, local_status, rev, updated_at)`` and
    ``repo_collections`` rows ``(collection, did, records)``."""
    rng = random.Random(seed)
    accounts: list[tuple[object, ...]] = []
    rows: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    while len(accounts) < n:
        did = "did:plc:" + "".join(rng.choice(_B32) for _ in range(24))
        if did in seen:
            continue
        seen.add(did)
        upstream, local = rng.choice(STATUSES)
        accounts.append((did, f"pds{rng.randrange(50)}.example.com", upstream, local, "3l" + "a" * 11, time.time()))
        for collection, p in COLLECTIONS.items():
            if rng.random() < p:
                rows.append((collection, did, 1 + int(rng.expovariate(1 / 40))))
    return accounts, rows


def load_sqlite(path: str, accounts: list[tuple[object, ...]], rows: list[tuple[str, str, int]]) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.executemany("INSERT INTO accounts (did, host, upstream_status, local_status, rev, updated_at) "
                             "VALUES (?, ?, ?, ?, ?, ?)", accounts)
            conn.executemany("INSERT INTO repo_collections (collection, did, records) VALUES (?, ?, ?)", rows)
    finally:
        conn.close()


async def load_postgres(schema: str, accounts: list[tuple[object, ...]], rows: list[tuple[str, str, int]]) -> None:
    conn = await asyncpg.connect(PG_DSN)
    try:
        await conn.copy_records_to_table("accounts", schema_name=schema, records=accounts,
                                          columns=["did", "host", "upstream_status", "local_status", "rev", "updated_at"])
        await conn.copy_records_to_table("repo_collections", schema_name=schema, records=rows,
                                         columns=["collection", "did", "records"])
        # what autovacuum does after a bulk insert: statistics and the visibility map
        await conn.execute(f'VACUUM ANALYZE "{schema}".accounts, "{schema}".repo_collections')
    finally:
        await conn.close()


def query_mix(dids: list[str], count: int, seed: int = 7) -> list[tuple[str, str | None, int]]:
    rng = random.Random(seed)
    names = list(COLLECTIONS)
    out = []
    for i in range(count):
        cursor = rng.choice(dids) if i % 2 else None
        out.append((names[i % len(names)], cursor, LIMITS[(i // 2) % len(LIMITS)]))
    return out


def pct(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=100)
    return statistics.median(values), q[98], max(values)


def schedstat_ns(pid: int) -> int:
    """CPU time of process ``pid`` in ns (``/proc/<pid>/schedstat``, ns precision)."""
    with open(f"/proc/{pid}/schedstat") as fh:
        return int(fh.read().split()[0])


async def timed(calls: list[tuple[str, str | None, int]], call: Callable[[str, str | None, int], Awaitable[int]],
                server_pid: int | None = None) -> tuple[list[float], list[float], dict[str, float]]:
    """Each call's wall time and CPU time in ms (after a warm-up pass over the first 100), and the
    worst wall time per collection. CPU = this process (every thread) + ``server_pid`` if given:
    on a loaded machine the wall time includes waiting for a core, the CPU time does not."""
    for c in calls[:100]:
        await call(*c)
    times: list[float] = []
    cpu: list[float] = []
    worst: dict[str, float] = {}
    for c in calls:
        s0 = schedstat_ns(server_pid) if server_pid else 0
        c0 = time.process_time()
        t = time.perf_counter()
        await call(*c)
        ms = (time.perf_counter() - t) * 1000
        cpu.append((time.process_time() - c0) * 1000 + ((schedstat_ns(server_pid) - s0) / 1e6 if server_pid else 0.0))
        times.append(ms)
        worst[c[0]] = max(worst.get(c[0], 0.0), ms)
    return times, cpu, worst


async def explain(store: Store, backend: str, schema: str | None, probe: str) -> None:
    from backfill import postgres_store, sql_store

    if backend == "sqlite":
        path = store.path  # type: ignore[attr-defined]
        conn = sqlite3.connect(path)
        try:
            plan = conn.execute("EXPLAIN QUERY PLAN " + sql_store._REPOS_BY_COLLECTION_SQL,
                                ("app.bsky.feed.like", probe, 500)).fetchall()
        finally:
            conn.close()
        note("sqlite plan: " + " | ".join(str(r[-1]) for r in plan))
        return
    conn = await asyncpg.connect(PG_DSN, server_settings={"search_path": f'"{schema}"'})
    try:
        await conn.execute("SET plan_cache_mode = force_generic_plan")  # what a prepared statement ends up using
        stmt = await conn.prepare("EXPLAIN (ANALYZE, BUFFERS) " + postgres_store._numbered(sql_store._REPOS_BY_COLLECTION_SQL))
        rows = await stmt.fetch("app.bsky.feed.like", probe, 500)
    finally:
        await conn.close()
    note("postgres plan (generic):\n  " + "\n  ".join(r[0] for r in rows))


async def run_backend(backend: str, accounts: list[tuple[object, ...]], rows: list[tuple[str, str, int]],
                      queries: int, http: bool) -> None:
    tmp = tempfile.TemporaryDirectory(prefix="rbc-bench-")
    schema = None
    if backend == "sqlite":
        url = str(Path(tmp.name) / "relay.sqlite")
        store = await open_store(url)
        await store.migrate()
        t = time.perf_counter()
        load_sqlite(url, accounts, rows)
    else:
        schema = "bench_rbc_" + uuid.uuid4().hex[:10]
        url = f"{PG_DSN}?schema={schema}"
        store = await open_store(PG_DSN, schema=schema)
        await store.migrate()
        t = time.perf_counter()
        await load_postgres(schema, accounts, rows)
    note(f"{backend}: loaded {len(accounts)} accounts, {len(rows)} collection rows in {time.perf_counter() - t:.1f}s")
    b = "sqlite" if backend == "sqlite" else "pg"
    try:
        dids = sorted(str(a[0]) for a in accounts)
        calls = query_mix(dids, queries)
        await explain(store, backend, schema, dids[len(dids) // 2])

        async def via_store(collection: str, cursor: str | None, limit: int) -> int:
            return len(await store.list_repos_by_collection(collection, cursor, limit))

        times, cpu, worst = await timed(calls, via_store)
        p50, p99, mx = pct(times)
        result(f"rbc_{b}_store_p50_ms", p50)
        result(f"rbc_{b}_store_p99_ms", p99)
        result(f"rbc_{b}_store_max_ms", mx)
        # SQLite: the query runs in this process (a reader thread), so ``cpu`` is complete; Postgres:
        # the same SQL again on one connection whose backend's CPU is read from /proc
        if backend != "sqlite":
            from backfill.postgres_store import _SQL_REPOS_BY_COLLECTION

            conn = await asyncpg.connect(PG_DSN, server_settings={"search_path": f'"{schema}"'})
            try:
                stmt = await conn.prepare(_SQL_REPOS_BY_COLLECTION)

                async def via_conn(collection: str, cursor: str | None, limit: int) -> int:
                    return len(await stmt.fetch(collection, cursor or "", limit))

                backend_pid = await conn.fetchval("SELECT pg_backend_pid()")
                _, cpu, _ = await timed(calls, via_conn, server_pid=backend_pid)
            finally:
                await conn.close()
        result(f"rbc_{b}_store_cpu_p50_ms", pct(cpu)[0])
        result(f"rbc_{b}_store_cpu_p99_ms", pct(cpu)[1])
        note(f"{backend} store: worst per collection (ms) " + ", ".join(f"{c}={v:.1f}" for c, v in worst.items()))
        for limit in LIMITS:
            sub = [x for x, c in zip(times, calls, strict=True) if c[2] == limit]
            result(f"rbc_{b}_store_p99_ms_limit_{limit}", pct(sub)[1])
            sub = [x for x, c in zip(cpu, calls, strict=True) if c[2] == limit]
            result(f"rbc_{b}_store_cpu_p99_ms_limit_{limit}", pct(sub)[1])
        # paging through the biggest collection
        t = time.perf_counter()
        pages, cursor, total = 0, None, 0
        while True:
            got = await store.list_repos_by_collection("app.bsky.actor.profile", cursor, 2000)
            pages += 1
            total += len(got)
            if len(got) < 2000:
                break
            cursor = got[-1]
        result(f"rbc_{b}_walk_pages", pages)
        result(f"rbc_{b}_walk_accounts", total)
        result(f"rbc_{b}_walk_seconds", time.perf_counter() - t)
        await store.close()
        if http:
            async with relay("http://127.0.0.1:9", database_url=url) as r, \
                    httpx.AsyncClient(base_url=r.url, timeout=30) as client:

                async def via_http(collection: str, cursor: str | None, limit: int) -> int:
                    params: dict[str, str | int] = {"collection": collection, "limit": limit}
                    if cursor is not None:
                        params["cursor"] = cursor
                    resp = await client.get("/xrpc/com.atproto.sync.listReposByCollection", params=params)
                    resp.raise_for_status()
                    return len(resp.json()["repos"])

                times, _, _ = await timed(calls, via_http)
                p50, p99, mx = pct(times)
                result(f"rbc_{b}_http_p50_ms", p50)
                result(f"rbc_{b}_http_p99_ms", p99)
                result(f"rbc_{b}_http_max_ms", mx)
                for limit in LIMITS:
                    sub = [x for x, c in zip(times, calls, strict=True) if c[2] == limit]
                    result(f"rbc_{b}_http_p99_ms_limit_{limit}", pct(sub)[1])
    finally:
        if schema is not None:
            conn = await asyncpg.connect(PG_DSN)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()
        tmp.cleanup()


async def main_async(backends: list[str], n: int, queries: int, http: bool) -> None:
    t = time.perf_counter()
    accounts, rows = make_data(n)
    note(f"generated {n} accounts / {len(rows)} rows in {time.perf_counter() - t:.1f}s")
    result("rbc_load_average", load_average())
    result("rbc_accounts", n)
    result("rbc_collection_rows", len(rows))
    for backend in backends:
        await run_backend(backend, accounts, rows, queries, http)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--accounts", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=3000)
    p.add_argument("--no-http", action="store_true", help="measure the store only (no relay child)")
    a = p.parse_args()
    backends = ["sqlite", "postgres"] if a.backend == "both" else [a.backend]
    asyncio.run(main_async(backends, a.accounts, a.queries, not a.no_http))
    return 0


if __name__ == "__main__":
    sys.exit(main())
