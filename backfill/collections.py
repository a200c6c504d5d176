"""Which accounts have records in which collection: per-(did, collection) record counts kept by the
sequencer, atomically with the events that change them (``listReposByCollection``).

Pure bookkeeping here; the stores write it (table ``repo_collections`` of migration 0080) in the
sequencer's batch transaction:

* every sequenced ``#commit`` adds its ops: a ``create`` +1, a ``delete`` -1; after a ``create``
  or an ``update`` the count is at least 1 (a record is known to exist). An account *enters* a
  collection with its first record there;
* an event carrying ``PendingEvent.collections`` (a ``#sync`` of a resync: counts from a walk of the
  whole verified repository) replaces the account's counts, and so do Spark jobs that walked the
  repository (``spark.collections``); from then on the account's counts are *exact* (table
  ``repo_collections_exact``, migration 0097): every op since was counted;
* an account *leaves* a collection when its count falls to 0 (the row is deleted) — only if its
  counts are exact. Otherwise they are lower bounds (an account first seen mid-history only knows
  the records it has seen created, and a delete may name a record the relay never counted), so a
  delete never takes an existing row below 1: the account may stay listed after deleting its last
  record there, until a walk makes its counts exact, but is never dropped while it still holds
  records. Counts never go below 0.

Per batch, :class:`CollectionChanges` folds everything into one reset per account (applied first)
and one ``(collection, did, delta, floor)`` row per pair (``records = max(floor, records + delta)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from firehose.state import PendingEvent, commit_op_changes
from mst.cbor import decode, decode_prefix

_OPS_KEY = b"\x63ops"  # "ops": the first key of a canonical #commit body (shortest keys first)


def counts_from_paths(paths: Iterable[str]) -> dict[str, int]:
    """Record counts per collection of a repository's record paths (``collection/rkey``)."""
    counts: dict[str, int] = {}
    for path in paths:
        collection = path.partition("/")[0]
        counts[collection] = counts.get(collection, 0) + 1
    return counts


def commit_ops(event: PendingEvent) -> list[Any]:
    """The ``ops`` of a ``#commit`` event, from ``body`` or (pre-encoded) ``body_cbor``."""
    raw = event.body_cbor
    if raw is None:
        ops = event.body.get("ops")
        return ops if isinstance(ops, list) else []
    head = raw[0] if raw else 0
    start = 1 if 0xA0 <= head <= 0xB7 else 2 if head == 0xB8 else 0
    if start and raw[start:start + 4] == _OPS_KEY:
        ops, _ = decode_prefix(memoryview(raw)[start + 4:])
    else:  # not canonical: decode the whole body
        body = decode(raw)
        ops = body.get("ops") if isinstance(body, dict) else None
    return ops if isinstance(ops, list) else []


class CollectionChanges:
    """The collection changes of one sequencer batch, in event order."""

    __slots__ = ("resets", "_deltas")

    def __init__(self) -> None:
        #: did → complete counts (replacing what is stored), applied before the deltas
        self.resets: dict[str, dict[str, int]] = {}
        self._deltas: dict[tuple[str, str], list[int]] = {}  # (collection, did) → [delta, floor]

    def add(self, event: PendingEvent) -> None:
        """Account for one sequenced event."""
        if event.collections is not None:
            self.reset(event.did, event.collections)
        elif event.kind == "#commit":
            changes = event.op_changes
            self.add_changes(event.did, commit_op_changes(commit_ops(event)) if changes is None else changes)

    def reset(self, did: str, counts: Mapping[str, int]) -> None:
        for key in [k for k in self._deltas if k[1] == did]:
            del self._deltas[key]
        self.resets[did] = {c: n for c, n in counts.items() if n > 0}

    def add_changes(self, did: str, changes: Iterable[tuple[str, str]]) -> None:
        """Account for ``firehose.state.commit_op_changes`` of a ``#commit``."""
        deltas = self._deltas
        for collection, action in changes:
            entry = deltas.setdefault((collection, did), [0, 0])
            if action == "create":
                entry[0] += 1
            elif action == "delete":
                entry[0] -= 1
            # the floor: after a create or an update at least that record exists
            entry[1] = 0 if action == "delete" else 1

    def deltas(self) -> list[tuple[str, str, int, int]]:
        """``(collection, did, delta, floor)`` rows: ``records = max(floor, records + delta)``."""
        return [(c, d, v[0], v[1]) for (c, d), v in self._deltas.items()]

    def __bool__(self) -> bool:
        return bool(self.resets or self._deltas)
