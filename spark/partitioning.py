"""Spreading accounts over Spark tasks so per-host limits hold and reads run in parallel.

* ``read_accounts_rdd(sc, cfg, flt)``: the selected accounts, read by the executors themselves in
  contiguous DID ranges (one DB connection per range) — measured against Spark's JDBC source in
  ``bench/spark.py``; the Python read also serves the SQLite embedded default.
* ``by_host_shard(rdd, cfg, parts)``: re-partition so that all accounts of one (host, shard) meet
  in one task; a host's accounts are spread over ``fetch.shards_per_host`` shards, each of which
  gets that fraction of the host's rate and concurrency budget.
* ``for_each_host(cfg, items, work)``: inside a task, run ``work(fetcher, identities, account)``
  for each account with the host's share of concurrency, one host after another.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from spark.config import JobConfig
from spark.db import connect_db
from spark.fetch import HostFetcher, base_url_for
from spark.identity import IdentityClient
from spark.relaydb import AccountFilter, did_boundaries, read_accounts
from spark.repo_check import StoredAccount

if TYPE_CHECKING:  # pragma: no cover
    from pyspark import RDD, SparkContext

T = TypeVar("T")

#: accounts a task holds at most (a task groups its accounts by host in memory)
MAX_ACCOUNTS_PER_TASK = 50_000


def work_partitions(parts: int, selected: int) -> int:
    """Tasks for the fetch stage: at least ``parts``, and enough to bound each task's memory."""
    return max(1, parts, -(-selected // MAX_ACCOUNTS_PER_TASK))


def _read_range(db_url: str, flt: AccountFilter, bound: tuple[str | None, str | None]) -> list[StoredAccount]:
    with connect_db(db_url) as db:
        return read_accounts(db, bound[0], bound[1], flt)


def read_accounts_rdd(
    sc: SparkContext, cfg: JobConfig, flt: AccountFilter, parts: int
) -> tuple[RDD[StoredAccount], int]:
    """Return (RDD[StoredAccount], number of accounts selected)."""
    with connect_db(cfg.db_url) as db:
        bounds = did_boundaries(db, parts, flt)
        where, args = flt.where()
        total = int(db.fetchval(f"SELECT count(*) FROM accounts a WHERE {where}", *args) or 0)
    db_url = cfg.db_url
    rdd = sc.parallelize(bounds, len(bounds)).flatMap(lambda b: _read_range(db_url, flt, b))
    return rdd, total


def host_shard(account: StoredAccount, shards: int) -> tuple[str, int]:
    """Stable (host, shard) key for an account."""
    shard = zlib.crc32(account.did.encode()) % shards if shards > 1 else 0
    return (account.host or "", shard)


def _partition_of(key: tuple[str, int]) -> int:
    return zlib.crc32(f"{key[0]}#{key[1]}".encode())


def by_host_shard(rdd: RDD[StoredAccount], cfg: JobConfig, parts: int) -> RDD[StoredAccount]:
    """RDD[StoredAccount] → RDD[StoredAccount] partitioned by (host, shard)."""
    shards = max(1, cfg.fetch.shards_per_host)
    return (
        rdd.map(lambda a: (host_shard(a, shards), a))
        .partitionBy(parts, _partition_of)
        .values()
    )


def for_each_host(
    cfg: JobConfig,
    accounts: Iterable[StoredAccount],
    work: Callable[[HostFetcher, IdentityClient, StoredAccount], T],
) -> Iterator[T]:
    """Run ``work`` for every account, grouped by host, ``fetch.host_concurrency`` (this task's
    share) at a time per host; results are yielded as they complete, in input order per host."""
    groups: dict[str, list[StoredAccount]] = defaultdict(list)
    for account in accounts:
        groups[account.host or ""].append(account)
    share = 1.0 / max(1, cfg.fetch.shards_per_host)
    identities = IdentityClient(cfg.fetch)
    try:
        for host, members in groups.items():
            with HostFetcher(base_url_for(host, cfg.fetch.scheme), cfg.fetch, share) as fetcher:
                with ThreadPoolExecutor(max_workers=fetcher.concurrency) as pool:
                    # bounded look-ahead: never more than a few chunks of futures in flight
                    for chunk in batched(members, fetcher.concurrency * 8):
                        yield from pool.map(lambda acc, f=fetcher: work(f, identities, acc), chunk)
    finally:
        identities.close()


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
