"""Rebuild accounts' collection counts (``repo_collections``, migration 0080) from whole verified
repositories, in a Spark job's own write transaction.

The relay keeps the counts inline from the ops it sequences (``backfill.collections``); a job that
has walked a repository replaces them with the truth and marks them exact (table
``repo_collections_exact``: from then on the relay's deltas keep them exact). The replacement is a compare-and-set on the
account's stored ``rev``: it happens only while the relay still holds the account at exactly the
revision the job verified (the job's own write of a repaired account's state, earlier in the same
transaction, counts). On PostgreSQL the account row is locked first (``FOR UPDATE``): the
sequencer writes an account before its collection changes in the same transaction, so a commit
landing meanwhile either waits for this rebuild and applies its ops on top, or has moved ``rev``
already and the rebuild is skipped. SQLite serialises writers anyway.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from spark.db import JobDB, PostgresDB


@dataclass(frozen=True, slots=True)
class RepoCollections:
    """One verified repository's record counts per collection, at ``rev``."""

    did: str
    rev: str
    counts: dict[str, int]

    @classmethod
    def of(cls, did: str, rev: str, paths: Sequence[str] | dict[str, object]) -> RepoCollections:
        counts: dict[str, int] = {}
        for collection, start, end in collection_runs(sorted(paths)):  # in order already: linear
            counts[collection] = counts.get(collection, 0) + end - start
        return cls(did, rev, counts)


def collection_runs(paths: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(collection, start, end)`` of each collection's run in ``paths`` (sorted record paths,
    ``collection/rkey``): one binary search per collection instead of a look at every path. A
    path without ``/`` (not a valid repository path) is a run of its own, named as
    ``backfill.collections.counts_from_paths`` names it, so summed per name the counts are equal."""
    runs: list[tuple[str, int, int]] = []
    i, n = 0, len(paths)
    while i < n:
        collection, slash, _ = paths[i].partition("/")
        # "0" follows "/" in every ordering of str: the first path past "<collection>/…"
        end = bisect_left(paths, collection + "0", i) if slash else i + 1
        runs.append((collection, i, end))
        i = end
    return runs


def rebuild_collections(db: JobDB, snapshots: Sequence[RepoCollections]) -> int:
    """Replace the counts of every account still at its snapshot's ``rev``; returns how many were
    replaced. Call inside the job's write transaction."""
    lock = " FOR UPDATE" if isinstance(db, PostgresDB) else ""
    done = 0
    for snap in sorted(snapshots, key=lambda s: s.did):  # row locks in one order: no deadlock
        rows = db.fetch(f"SELECT rev FROM accounts WHERE did = ?{lock}", snap.did)
        if not rows or rows[0]["rev"] != snap.rev:
            continue
        db.execute("DELETE FROM repo_collections WHERE did = ?", snap.did)
        db.executemany("INSERT INTO repo_collections (collection, did, records) VALUES (?, ?, ?)",
                       [(c, snap.did, n) for c, n in sorted(snap.counts.items()) if n > 0])
        db.execute("INSERT INTO repo_collections_exact (did) VALUES (?) ON CONFLICT (did) DO NOTHING", snap.did)
        done += 1
    return done


def inexact_dids(db: JobDB, dids: Sequence[str]) -> set[str]:
    """Those of ``dids`` whose stored counts are not exact (no walk installed them yet)."""
    if not dids:
        return set()
    marks = ",".join("?" * len(dids))
    exact = {row["did"] for row in db.fetch(f"SELECT did FROM repo_collections_exact WHERE did IN ({marks})", *dids)}
    return set(dids) - exact
