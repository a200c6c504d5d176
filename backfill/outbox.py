"""The relay side of the repair outbox: Spark's findings applied by the single writer, each with a
compare-and-set against the account's state as the relay holds it at apply time.

The Spark jobs never write ``accounts`` or events. They queue rows in ``spark_repair_outbox``
(migrations 0070, 0075), each carrying what the job saw (``base_*``) and when it looked at the
host (``observed_at``):

* ``#sync``   — resync verified the host's repository at ``rev``/``commit_cid``/``data_cid``;
* ``#account``— reconcile saw another hosting status (``active``/``status``), ``deleted``
  included (an account its host confirms it no longer hosts);
* ``desync``  — reconcile saw another head: the account should be resynchronised;
* ``add``     — reconcile found an account the relay did not know (its DID names this host).

The running relay drains the rows (``drain_repair_outbox``) and applies each one in its account's
lane (``relay.ingest.lanes.AccountLanes.apply_repair``), where ``decide_repair`` compares it with the lane's
durable state (the lane waits until nothing is in flight, so durable *is* the relay's head):

* a repair not newer than what the relay has accepted since the job looked is discarded
  (``stale``), so a job never rolls an account back and never duplicates what the live stream
  already delivered;
* a row is applied only once the relay has *caught up* with the row's host past ``observed_at``
  (``ready``, from ``relay.ingest.hostruns.Upstreams.caught_up``): a job run while the relay is behind
  waits for the relay to read what the host sent before the job looked, and is then stale unless
  the relay really missed it. Without that rule a ``#sync`` would move the account past commits
  still on their way, and the relay would drop them as "not newer".

Every row is marked consumed with its ``outcome`` and the seq of the event it became (if any).
Delivery is at-least-once: a crash between apply and mark re-applies the row, which is then
``stale`` (the state it set is durable) and emits nothing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from backfill.store import Store
from firehose.state import AccountState

KINDS = ("#sync", "#account", "desync", "add")


class RepairOutcome(StrEnum):
    """What the relay did with one outbox row (``spark_repair_outbox.outcome``)."""

    APPLIED = "applied"  # the account changed (and an event was emitted where one is due)
    DESYNC_CLEARED = "desync_cleared"  # the relay already held the verified state: mark cleared
    STALE = "stale"  # not newer than what the relay accepted since the job looked: discarded
    UNKNOWN_ACCOUNT = "unknown_account"  # the relay does not know the account (any more)
    INACTIVE = "inactive"  # a #sync of an account whose events are not redistributed
    BAD_ROW = "bad_row"  # a row of an unknown kind or missing its fields


@dataclasses.dataclass(frozen=True, slots=True)
class Repair:
    """One outbox row (see the module docstring)."""

    id: int
    kind: str
    did: str
    host: str | None = None
    rev: str | None = None
    commit_cid: str | None = None
    data_cid: str | None = None
    blocks: bytes | None = None
    active: bool | None = None
    status: str | None = None
    base_rev: str | None = None
    base_commit_cid: str | None = None
    base_status: str | None = None
    observed_at: float = 0.0
    #: ``#sync``: the verified repository's record counts per collection (None: not sent)
    collections: dict[str, int] | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Repair:
        blocks = row.get("blocks")
        active = row.get("active")
        observed = row.get("observed_at") or row.get("created_at") or 0.0
        counts = _counts(row.get("collections"))
        return cls(
            id=int(row["id"]), kind=str(row["kind"]), did=str(row["did"]), host=row.get("host"),
            rev=row.get("rev"), commit_cid=row.get("commit_cid"), data_cid=row.get("data_cid"),
            blocks=bytes(blocks) if blocks is not None else None,
            active=None if active is None else bool(active), status=row.get("status"),
            base_rev=row.get("base_rev"), base_commit_cid=row.get("base_commit_cid"),
            base_status=row.get("base_status"), observed_at=float(observed), collections=counts,
        )

    @property
    def upstream_status(self) -> str:
        """The hosting status an ``#account``/``add`` row reports."""
        if self.active is not False:
            return "active"
        return self.status or "deactivated"


def _counts(raw: object) -> dict[str, int] | None:
    """The ``collections`` column (JSON object of collection → count), or None if absent/unusable."""
    if not isinstance(raw, str) or not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int) and v > 0}


def decide_repair(repair: Repair, durable: AccountState | None) -> RepairOutcome:
    """Compare-and-set (pure): may ``repair`` be applied on top of ``durable``, the account's
    state as the relay holds it now (nothing in flight)?"""
    if repair.kind not in KINDS:
        return RepairOutcome.BAD_ROW
    if repair.kind == "add":
        return RepairOutcome.APPLIED if durable is None else RepairOutcome.STALE
    if durable is None:
        return RepairOutcome.UNKNOWN_ACCOUNT
    if repair.host and durable.host and repair.host != durable.host:
        return RepairOutcome.STALE  # the account moved since the job looked at the old host
    if repair.kind == "#account":
        if durable.upstream_status == repair.upstream_status:
            return RepairOutcome.STALE
        if repair.base_status is not None and durable.upstream_status != repair.base_status:
            return RepairOutcome.STALE  # the relay saw a status change of its own since
        return RepairOutcome.APPLIED
    if repair.kind == "desync":
        if durable.sync_state != "synced":
            return RepairOutcome.STALE  # already being resynchronised
        if (durable.rev, durable.commit_cid) != (repair.base_rev, repair.base_commit_cid):
            return RepairOutcome.STALE  # the relay moved since the job looked
        return RepairOutcome.APPLIED
    # "#sync"
    if not (repair.rev and repair.commit_cid and repair.data_cid and repair.blocks):
        return RepairOutcome.BAD_ROW
    if not durable.active or durable.sync_state == "throttled":
        return RepairOutcome.INACTIVE
    if durable.rev is not None and repair.rev <= durable.rev:
        if (repair.rev == durable.rev and repair.commit_cid == durable.commit_cid
                and durable.sync_state != "synced"):
            return RepairOutcome.DESYNC_CLEARED
        return RepairOutcome.STALE
    return RepairOutcome.APPLIED


def repaired_state(repair: Repair, durable: AccountState, now: float) -> AccountState:
    """The state an applied ``#sync`` repair installs (statuses kept from ``durable``)."""
    return dataclasses.replace(durable, rev=repair.rev, commit_cid=repair.commit_cid, data_cid=repair.data_cid,
                               host=durable.host or repair.host, sync_state="synced", updated_at=now)


@dataclasses.dataclass(slots=True)
class DrainResult:
    consumed: int = 0
    deferred: int = 0  # rows left pending because the relay has not caught up with their host


Apply = Callable[[Repair], Awaitable[tuple[RepairOutcome, int | None]]]


async def drain_repair_outbox(store: Store, apply: Apply, ready: Callable[[Repair], bool] = lambda _r: True,
                              *, page: int = 500, max_rows: int = 10_000) -> DrainResult:
    """Apply pending rows in outbox order through ``apply`` (the relay's lanes), marking each one
    consumed with its outcome. A row whose ``ready`` is false stays pending, and so do the later
    rows of the same account (their order is kept). Looks at ``max_rows`` rows at most per call;
    store errors propagate (the caller retries the next time)."""
    result = DrainResult()
    after = 0
    waiting: set[str] = set()
    while result.consumed + result.deferred < max_rows:
        rows = await store.pending_repairs(page, after)
        if not rows:
            break
        for row in rows:
            repair = Repair.from_row(row)
            after = repair.id
            if repair.did in waiting or not ready(repair):
                waiting.add(repair.did)
                result.deferred += 1
                continue
            outcome, seq = await apply(repair)
            await store.mark_repair_consumed(repair.id, time.time(), seq, outcome.value)
            result.consumed += 1
        if len(rows) < page:
            break
    return result
