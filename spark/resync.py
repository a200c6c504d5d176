"""Mass resync: re-verify selected repositories from their hosts and repair the relay's state.

``run_resync(spark, cfg, flt) -> dict`` (summary: counts per outcome, selected, run id).

Per repository (in executors, grouped by host, with the host's rate/concurrency share, SSRF
check, timeouts and retries — see ``spark.partitioning`` and ``spark.fetch``): ``getRepo``, resolve
the signing key, verify signature + every block hash + the full MST (``mst.verify``), compare with
the stored state (``spark.repo_check.judge``). Every ``cfg.write_batch`` repositories one
transaction writes the results rows (did, host, outcome ok/queued/failed, reason, records,
bytes) and one ``#sync`` row per ``queued`` account into ``spark_repair_outbox``. The job never
writes account state: the running relay applies each row in the account's lane with a
compare-and-set against its state at that moment (``backfill.outbox``), so ``queued`` means
"queued for the relay"; the row's ``outcome`` says whether the relay applied it or discarded it
as stale (the relay had caught up meanwhile): ``relaydb.repair_outcomes``.
Verified accounts the relay holds at the verified rev get their collection counts rebuilt
(``spark.collections``, a compare-and-set on the stored rev in the same transaction).

Resumable: a rerun with the same run id skips repositories that already have a result
(``retry_failed`` re-attempts the failed ones). Idempotent: a fresh run over accounts the relay
has applied finds them ``ok`` and queues nothing; one before the relay applied the first run's
rows queues nothing new either (the rows are keyed by did, rev and commit).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spark.collections import RepoCollections, rebuild_collections
from spark.config import JobConfig
from spark.db import connect_db
from spark.fetch import HostFetcher
from spark.identity import IdentityClient
from spark.partitioning import (
    batched,
    by_host_shard,
    for_each_host,
    host_order,
    quiet_gc,
    read_accounts_rdd,
    work_partitions,
)
from spark.relaydb import (
    AccountFilter,
    ResultRow,
    SyncRepair,
    finish_run,
    queue_sync_repairs,
    result_counts,
    start_run,
    write_results,
)
from spark.repo_check import CheckError, StoredAccount, fetch_verified, judge, sync_blocks

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

JOB = "resync"


def check_account(
    fetcher: HostFetcher, identities: IdentityClient, account: StoredAccount
) -> tuple[ResultRow, SyncRepair | None, RepoCollections | None]:
    """Fetch, verify and judge one account (never raises for bad input); with the verified
    repository's collection counts."""
    try:
        fetched = fetch_verified(fetcher, identities, account.did)
    except CheckError as exc:
        return ResultRow(account.did, account.host, "failed", exc.reason), None, None
    observed_at = time.time()  # the host's state is at least this recent
    counts = RepoCollections.of(account.did, fetched.rev, fetched.records)
    verdict = judge(account, fetched)
    row = ResultRow(
        account.did, account.host, verdict.outcome, verdict.reason,
        records=len(fetched.records), bytes=fetched.size, rev=fetched.rev,
    )
    if verdict.outcome != "queued":
        return row, None, counts if verdict.outcome == "ok" else None
    repair = SyncRepair(
        did=account.did, host=account.host, rev=fetched.rev, commit_cid=fetched.commit_cid,
        data_cid=fetched.data_cid, blocks=sync_blocks(fetched), base=account, observed_at=observed_at,
        collections=counts.counts,
    )
    return row, repair, counts


def resync_partition(cfg: JobConfig, accounts: Iterable[StoredAccount]) -> Iterator[tuple[str, str]]:
    """Executor side: check every account and write back in batches; yields (outcome, reason)."""
    with quiet_gc():
        checked = for_each_host(cfg, accounts, check_account)
        with connect_db(cfg.db_url) as db:
            for batch in batched(checked, cfg.write_batch):
                rows = [row for row, _, _ in batch]
                repairs = [repair for _, repair, _ in batch if repair is not None]
                with db.transaction():
                    queue_sync_repairs(db, cfg.run_id, repairs)
                    rebuild_collections(db, [counts for _, _, counts in batch if counts is not None])
                    write_results(db, cfg.run_id, JOB, rows)
                for row in rows:
                    yield row.outcome, row.reason or ""


def count_outcomes(pairs: Iterable[tuple[str, str]]) -> dict[str, int]:
    """``outcome`` or ``outcome:reason`` → count."""
    return dict(Counter(f"{o}:{r}" if r else o for o, r in pairs))


def run_resync(spark: SparkSession, cfg: JobConfig, flt: AccountFilter) -> dict[str, Any]:
    """Driver side: select, distribute, verify, queue for the relay; returns the run's summary."""
    sc = spark.sparkContext
    parts = cfg.partitions or max(1, sc.defaultParallelism)
    flt = replace(flt, skip_finished_run=cfg.run_id)
    with connect_db(cfg.db_url) as db:
        start_run(db, cfg.run_id, JOB, {"filter": repr(flt)})
    accounts, selected = read_accounts_rdd(sc, cfg, flt, parts)
    sc.setJobDescription(f"resync {cfg.run_id}: {selected} repositories")
    per_task = (
        by_host_shard(accounts, cfg, work_partitions(parts, selected), host_order(cfg, flt))
        .mapPartitions(lambda it: [count_outcomes(resync_partition(cfg, it))])
        .collect()  # one small dict per task: no second shuffle
    )
    outcomes: Counter[str] = Counter()
    for counts in per_task:
        outcomes.update(counts)
    with connect_db(cfg.db_url) as db:
        totals = result_counts(db, cfg.run_id)
        summary = {
            "run_id": cfg.run_id,
            "job": JOB,
            "selected_this_pass": selected,
            "this_pass": dict(sorted(outcomes.items())),
            "totals": totals,
        }
        finish_run(db, cfg.run_id, summary)
    return summary
