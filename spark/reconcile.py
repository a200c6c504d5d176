"""Anti-entropy: compare every host's ``listRepos`` with what the relay believes.

``run_reconcile(spark, cfg, hosts=None) -> dict`` — hosts default to the relay's ``hosts`` table.
One task per host pages ``com.atproto.sync.listRepos`` (did, head, rev, active, status) with the
host's rate limit, SSRF check, timeouts and retries, and for each page compares with the stored
accounts (outcome per account, written to ``spark_job_results``):

* ``status_diverged`` → an ``#account`` with the host's status is queued;
* ``head_diverged`` → a ``desync`` is queued (the relay marks the account desynchronized and
  resyncs it); an account the relay is ahead on is ``relay_ahead``, untouched;
* ``added`` → an account the relay did not know, whose DID document names this host as its PDS:
  an ``add`` is queued (the relay stores it desynchronized and resyncs it); otherwise
  ``not_added`` (``pds_mismatch`` or the DID resolution failure);
* ``host_mismatch`` → listed here but the relay has it on another host (reported only);
* an account the relay has on this host that the host does not list is checked with
  ``getRepoStatus`` and its DID document (``confirm_missing``): ``deleted`` (an ``#account``
  ``deleted`` is queued), ``status_diverged``, ``moved_away`` or ``missing_on_host`` (reported);
* ``invalid_entry`` → a malformed entry (reason ``bad_did``/``bad_head``/``bad_rev``; ignored);
* ``ok`` otherwise. A host that cannot be listed yields one ``host_failed`` entry in the summary.

Collection counts (``listReposByCollection``): every ``ok`` account whose counts are not exact yet
(``spark.collections.inexact_dids``: no walk of its whole repository installed them) is fetched
and verified (``spark.repo_check.fetch_verified``) and its counts rebuilt from the walk, with the
compare-and-set on the stored rev (``spark.collections.rebuild_collections``); the other outcomes
need no walk here (a diverged or added account is resynced by the relay, whose ``#sync`` installs
its counts). So after one run every account the relay holds at its host's rev has exact counts,
and the relay keeps them exact from then on. The summary's ``collections`` says per host how many
were ``counted``, ``skipped`` (the account moved past the walked rev meanwhile: the next run) or
``failed:<reason>``.

Nothing here writes account state: every finding is a row in ``spark_repair_outbox`` that the
running relay applies in the account's lane with a compare-and-set, once it has caught up with
the host past the moment the page was fetched (``backfill.outbox``), so a finding the relay's own
stream has overtaken is discarded as stale. Idempotent: a second run after the relay applied
the first finds nothing to change.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spark.collections import RepoCollections, inexact_dids, rebuild_collections
from spark.config import JobConfig
from spark.db import JobDB, connect_db
from spark.fetch import FetchError, HostFetcher, base_url_for
from spark.identity import IdentityClient, IdentityError
from spark.partitioning import batched
from spark.relaydb import (
    Finding,
    ResultRow,
    accounts_by_did,
    dids_on_host,
    finish_run,
    queue_findings,
    start_run,
    write_results,
)
from spark.repo_check import CheckError, StoredAccount, fetch_verified, same_host

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

JOB = "reconcile"
PAGE_LIMIT = 1000
MAX_PAGES = 1_000_000


def listed_status(entry: dict[str, Any]) -> str:
    """Upstream status from a ``listRepos`` entry (``active`` defaults to true)."""
    if entry.get("active", True) is not False:
        return "active"
    status = entry.get("status")
    return status if isinstance(status, str) and status else "deactivated"


def entry_problem(entry: dict[str, Any]) -> str | None:
    """Why a ``listRepos`` entry is unusable (``bad_did``, ``bad_head``, ``bad_rev``), or None."""
    from mst.syntax import is_valid_cid_string, is_valid_did, is_valid_tid

    if not is_valid_did(entry["did"]):
        return "bad_did"
    head = entry.get("head")
    if not isinstance(head, str) or not is_valid_cid_string(head):
        return "bad_head"
    rev = entry.get("rev")
    if not isinstance(rev, str) or not is_valid_tid(rev):
        return "bad_rev"
    return None


def compare_entry(host: str, entry: dict[str, Any], stored: StoredAccount | None) -> ResultRow:
    """Pure comparison of one listed repository with the stored account. A malformed entry is
    ``invalid_entry`` (reason from ``entry_problem``) and changes nothing."""
    did = entry["did"]
    problem = entry_problem(entry)
    if problem is not None:
        return ResultRow(did, host, "invalid_entry", problem)
    status = listed_status(entry)
    rev = entry.get("rev")
    if stored is None:
        return ResultRow(did, host, "added", status, rev=rev)
    if stored.host != host:
        return ResultRow(did, host, "host_mismatch", None, rev=rev)
    if stored.upstream_status != status:
        return ResultRow(did, host, "status_diverged", status, rev=rev)
    if entry.get("head") != stored.commit_cid or rev != stored.rev:
        if stored.rev is not None and isinstance(rev, str) and stored.rev > rev:
            return ResultRow(did, host, "relay_ahead", None, rev=rev)
        return ResultRow(did, host, "head_diverged", stored.sync_state, rev=rev)
    return ResultRow(did, host, "ok", None, rev=rev)


def confirm_added(rows: list[ResultRow], identities: IdentityClient, host_url: str) -> list[ResultRow]:
    """An unknown account is only added when its DID document names this host as its PDS;
    otherwise it becomes ``not_added`` (reason ``pds_mismatch`` or the resolution failure)."""
    out = []
    for row in rows:
        if row.outcome == "added":
            try:
                pds = identities.resolve(row.did).pds
                if not same_host(pds, host_url):
                    row = ResultRow(row.did, row.host, "not_added", "pds_mismatch", rev=row.rev)
            except IdentityError as exc:
                row = ResultRow(row.did, row.host, "not_added", exc.reason, rev=row.rev)
        out.append(row)
    return out


def _apply_page(db: JobDB, cfg: JobConfig, host: str, rows: list[ResultRow],
                stored: dict[str, StoredAccount], observed_at: float) -> None:
    """Queue the page's findings for the relay (it applies them with a compare-and-set) and write
    the results, in one transaction."""
    findings = []
    for r in rows:
        base = stored.get(r.did)
        if r.outcome == "added":
            findings.append(Finding("add", r.did, host, r.reason or "active", None, observed_at))
        elif r.outcome == "status_diverged":
            findings.append(Finding("#account", r.did, host, r.reason or "active", base, observed_at))
        elif r.outcome == "head_diverged" and base is not None and base.sync_state == "synced":
            findings.append(Finding("desync", r.did, host, base.upstream_status, base, observed_at))
    with db.transaction():
        queue_findings(db, cfg.run_id, findings)
        write_results(db, cfg.run_id, JOB, rows)


def count_collections(db: JobDB, fetcher: HostFetcher, identities: IdentityClient,
                      dids: list[str]) -> dict[str, int]:
    """Walk each of ``dids`` whose collection counts are not exact and install exact counts
    (compare-and-set on the walked rev); returns ``counted``/``skipped``/``failed:<reason>`` counts."""
    out: dict[str, int] = defaultdict(int)
    snapshots: list[RepoCollections] = []
    for did in sorted(inexact_dids(db, dids)):
        try:
            fetched = fetch_verified(fetcher, identities, did)
        except CheckError as exc:
            out[f"failed:{exc.reason}"] += 1
            continue
        snapshots.append(RepoCollections.of(did, fetched.rev, fetched.records))
    if snapshots:
        with db.transaction():
            done = rebuild_collections(db, snapshots)
        out["counted"] += done
        out["skipped"] += len(snapshots) - done
    return out


def confirm_missing(fetcher: HostFetcher, identities: IdentityClient, host: str, base_url: str,
                    stored: StoredAccount) -> ResultRow:
    """An account the relay has on ``host`` that the host does not list: ask the host
    (``getRepoStatus``) and the DID document. ``deleted`` when the host no longer has the repository
    (``RepoNotFound``) or reports it deleted, or the DID is gone (tombstoned); ``status_diverged``
    when the host reports another inactive status; ``moved_away`` when the DID document names
    another PDS (the relay follows the move through ``#identity``: nothing queued); else
    ``missing_on_host`` (reported only; reason: what could not be confirmed)."""
    did = stored.did
    try:
        pds = identities.resolve(did).pds
    except IdentityError as exc:
        if exc.reason == "did_not_found":
            return ResultRow(did, host, "deleted", "did_not_found")
        return ResultRow(did, host, "missing_on_host", exc.reason)
    if not same_host(pds, base_url):
        return ResultRow(did, host, "moved_away", None)
    try:
        status = fetcher.get("/xrpc/com.atproto.sync.getRepoStatus", {"did": did}).json()
    except FetchError as exc:
        if exc.reason == "repo_not_found":
            return ResultRow(did, host, "deleted", "repo_not_found")
        return ResultRow(did, host, "missing_on_host", exc.reason)
    except ValueError:
        return ResultRow(did, host, "missing_on_host", "bad_status")
    if not isinstance(status, dict) or status.get("active", True) is not False:
        return ResultRow(did, host, "missing_on_host", "listed_active")
    reported = status.get("status")
    reported = reported if isinstance(reported, str) and reported else "deactivated"
    if reported == "deleted":
        return ResultRow(did, host, "deleted", "status_deleted")
    if reported != stored.upstream_status:
        return ResultRow(did, host, "status_diverged", reported)
    return ResultRow(did, host, "missing_on_host", "inactive")


def list_repos(fetcher: HostFetcher) -> Iterator[list[dict[str, Any]]]:
    """Pages of a host's ``listRepos`` (entries with a string ``did``, each DID once). Raises
    ``FetchError`` or ``ValueError``/``AttributeError`` for a malformed response."""
    seen: set[str] = set()
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = {"limit": str(PAGE_LIMIT)}
        if cursor:
            params["cursor"] = cursor
        page = fetcher.get("/xrpc/com.atproto.sync.listRepos", params, max_bytes=32 * 1024 * 1024).json()
        entries = [e for e in page.get("repos") or [] if isinstance(e, dict) and isinstance(e.get("did"), str)]
        entries = [e for e in entries if e["did"] not in seen]
        seen.update(e["did"] for e in entries)
        yield entries
        next_cursor = page.get("cursor")
        if not entries or not isinstance(next_cursor, str) or not next_cursor or next_cursor == cursor:
            return
        cursor = next_cursor


#: Prefix of the (host, outcome, count) triples that count collection walks, not listing outcomes.
COLLECTIONS = "collections:"


def reconcile_host(cfg: JobConfig, host: str) -> Iterator[tuple[str, str, int]]:
    """Executor side: page one host and reconcile it; yields (host, outcome, count), and
    (host, ``COLLECTIONS`` + what, count) for the collection walks."""
    counts: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    base = base_url_for(host, cfg.fetch.scheme)
    with connect_db(cfg.db_url) as db, HostFetcher(base, cfg.fetch) as fetcher:
        identities = IdentityClient(cfg.fetch)
        try:
            for entries in list_repos(fetcher):
                observed_at = time.time()  # the page shows the host's state at least this recent
                seen.update(e["did"] for e in entries)
                stored = accounts_by_did(db, [e["did"] for e in entries])
                rows = [compare_entry(host, e, stored.get(e["did"])) for e in entries]
                rows = confirm_added(rows, identities, base)
                _apply_page(db, cfg, host, rows, stored, observed_at)
                for row in rows:
                    counts[row.outcome] += 1
                walked = count_collections(db, fetcher, identities, [r.did for r in rows if r.outcome == "ok"])
                for what, n in walked.items():
                    counts[COLLECTIONS + what] += n
        except (FetchError, ValueError, AttributeError) as exc:
            counts[f"host_failed:{getattr(exc, 'reason', 'bad_listing')}"] += 1
        else:
            missing = sorted(dids_on_host(db, host) - seen)
            for chunk in batched(missing, PAGE_LIMIT):
                stored = accounts_by_did(db, chunk)
                rows = [confirm_missing(fetcher, identities, host, base, stored[did]) for did in chunk]
                observed_at = time.time()
                findings = []
                for r in rows:
                    status = "deleted" if r.outcome == "deleted" else r.reason or ""
                    if r.outcome in ("deleted", "status_diverged") and stored[r.did].upstream_status != status:
                        findings.append(Finding("#account", r.did, host, status, stored[r.did], observed_at))
                with db.transaction():
                    queue_findings(db, cfg.run_id, findings)
                    write_results(db, cfg.run_id, JOB, rows)
                for row in rows:
                    counts[row.outcome] += 1
        finally:
            identities.close()
    for outcome, n in counts.items():
        if n:
            yield host, outcome, n


def relay_hosts(db: JobDB) -> list[str]:
    """Hosts the relay subscribes to (the ``hosts`` table), excluding banned/blocked ones and relay
    upstreams (another relay is not authoritative for any account: reconcile against PDSes)."""
    rows = db.fetch("SELECT * FROM hosts")
    out = []
    for row in rows:
        name = row.get("hostname") or row.get("host")
        status = row.get("status") or "active"
        if name and status not in ("banned", "blocked") and not row.get("is_relay"):
            out.append(str(name))
    return sorted(out)


def run_reconcile(spark: SparkSession, cfg: JobConfig, hosts: list[str] | None = None) -> dict[str, Any]:
    """Driver side: one task per host; returns ``{"run_id", "hosts": {host: {outcome: n}},
    "collections": {host: {"counted"|"skipped"|"failed:<reason>": n}}}``."""
    sc = spark.sparkContext
    with connect_db(cfg.db_url) as db:
        targets = sorted(set(hosts)) if hosts else relay_hosts(db)
        start_run(db, cfg.run_id, JOB, {"hosts": targets})
    per_host: dict[str, dict[str, int]] = {h: {} for h in targets}
    walks: dict[str, dict[str, int]] = {h: {} for h in targets}
    if targets:
        sc.setJobDescription(f"reconcile {cfg.run_id}: {len(targets)} hosts")
        triples = (
            sc.parallelize(targets, len(targets))
            .flatMap(lambda h: reconcile_host(cfg, h))
            .collect()
        )
        for host, outcome, n in triples:
            into, key = (walks, outcome[len(COLLECTIONS):]) if outcome.startswith(COLLECTIONS) else (per_host, outcome)
            into[host][key] = into[host].get(key, 0) + n
    summary = {"run_id": cfg.run_id, "job": JOB, "hosts": per_host, "collections": walks}
    with connect_db(cfg.db_url) as db:
        finish_run(db, cfg.run_id, summary)
    return summary
