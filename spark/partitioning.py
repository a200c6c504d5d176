"""Spreading accounts over Spark tasks so per-host limits hold and reads run in parallel.

* ``read_accounts_rdd(sc, cfg, flt)``: the selected accounts, read by the executors themselves in
  contiguous DID ranges (one DB connection per range) — measured against Spark's JDBC source in
  ``bench/spark.py``; the Python read also serves the SQLite embedded default.
* ``by_host_shard(rdd, cfg, parts, hosts)``: re-partition so that all accounts of one (host, shard)
  meet in one task; a host's accounts are spread over ``fetch.shards_per_host`` shards, each of
  which gets that fraction of the host's rate and concurrency budget; with ``hosts`` (from
  ``host_order``) the keys are dealt out to the tasks evenly instead of by hash.
* ``for_each_host(cfg, items, work)``: inside a task, run ``work(fetcher, identities, account)``
  for each account with the host's share of concurrency, one host after another, each host's
  accounts in DID order.
* ``quiet_gc()``: garbage-collector settings for decoding-heavy tasks.
* ``cid_strs(cids)``: many CIDs to their string form in one C call.
"""

from __future__ import annotations

import gc
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from spark.config import JobConfig
from spark.db import connect_db
from spark.fetch import HostFetcher, base_url_for
from spark.identity import IdentityClient
from spark.relaydb import AccountFilter, did_boundaries, read_accounts
from spark.repo_check import StoredAccount

if TYPE_CHECKING:  # pragma: no cover
    from cbrrr import CID
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


def host_order(cfg: JobConfig, flt: AccountFilter) -> dict[str, int]:
    """Driver side: a number for every known host (``hosts`` table, or the filter's hosts), so
    that :func:`by_host_shard` can deal the (host, shard) keys out to tasks evenly."""
    if flt.hosts:
        names = sorted(set(flt.hosts))
    else:
        with connect_db(cfg.db_url) as db:
            names = [r["hostname"] for r in db.fetch("SELECT hostname FROM hosts ORDER BY hostname")]
    return {name: i for i, name in enumerate(names)}


def key_partition(key: tuple[str, int], shards: int, hosts: Mapping[str, int]) -> int:
    """Partition number of a (host, shard) key before ``mod parts``: consecutive numbers for
    the shards of the known hosts (so ``hosts * shards`` keys fill ``parts`` tasks evenly, never
    two keys on one task while another has none), a hash for a host not in ``hosts``."""
    index = hosts.get(key[0])
    if index is None:
        return zlib.crc32(f"{key[0]}#{key[1]}".encode())
    return index * shards + key[1]


def by_host_shard(
    rdd: RDD[StoredAccount], cfg: JobConfig, parts: int, hosts: Mapping[str, int] | None = None,
) -> RDD[StoredAccount]:
    """RDD[StoredAccount] → RDD[StoredAccount] partitioned by (host, shard) (``hosts``: see
    :func:`key_partition`)."""
    shards = max(1, cfg.fetch.shards_per_host)
    order = dict(hosts or {})
    return (
        rdd.map(lambda a: (host_shard(a, shards), a))
        .partitionBy(parts, lambda key: key_partition(key, shards, order))
        .values()
    )


@contextmanager
def quiet_gc(threshold: int = 50_000) -> Iterator[None]:
    """For a decoding-heavy task: move what already lives (the worker's imports, caches) out of
    the collector's sight (``gc.freeze``) and collect the young generation only every
    ``threshold`` allocations instead of 700: a repository's blocks and records are hundreds of
    thousands of short-lived containers, which the default thresholds rescan over and over.
    Restores the thresholds afterwards (Python workers are reused)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, before[1], before[2])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


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
    for members in groups.values():
        members.sort(key=lambda a: a.did)  # results in DID order: the export's files need no sort
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


def cid_strs(cids: list[CID]) -> list[str]:
    """``[cid_str(c) for c in cids]`` in one pass of cbrrr's C decoder (~10x faster): the CIDs go
    into one DAG-CBOR array of tag-42 links, decoded in atjson mode, which renders each link in
    base32 (``{"$link": "b…"}``)."""
    from cbrrr import _cbrrr

    from mst.cbor import encode_head

    parts = [encode_head(4, len(cids))]
    for cid in cids:
        raw = bytes(cid)
        parts.append(b"\xd8\x2a" + encode_head(2, len(raw) + 1) + b"\x00" + raw)
    links, _ = _cbrrr.decode_dag_cbor(b"".join(parts), bytes, True)  # atjson mode: the ctor is unused
    return [link["$link"] for link in links]
