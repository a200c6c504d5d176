"""The relay side of the repair outbox: turn queued repairs into sequenced ``#sync``/``#account``.

The Spark jobs never write events themselves (the sequencer is the single writer). They queue
rows in ``spark_repair_outbox``; the running relay calls

    await drain_repair_outbox(store, sequencer.submit)

periodically (or after a job finishes). Each pending row becomes one ``PendingEvent`` (see
``event_for``); after ``submit`` resolves, the row is marked consumed with the assigned ``seq``. Delivery is at-least-once: a crash
between the two steps re-emits the same ``#sync`` (same rev), which consumers treat as a no-op.

Reads and marks the rows through the relay's own ``Store`` (``pending_repairs``/``mark_repair_consumed``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from backfill.store import Store
from firehose.state import PendingEvent

Submit = Callable[[PendingEvent], Awaitable[Any]]



def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def event_for(row: dict[str, Any], now: float) -> PendingEvent | None:
    """The event for one outbox row (None when the account has vanished from the relay, or for
    a ``#sync`` of an account that is not active by now: the row is then consumed without seq).

    The job has already written the account's state, so the event carries no ``account`` (the
    sequencer must not overwrite a newer state with this snapshot) and no ``rev`` (the
    sequencer's re-delivery check would drop a ``#sync`` whose rev equals the stored one).
    """
    if row.get("upstream_status") is None:
        return None
    if row["kind"] == "#sync":
        if row["upstream_status"] != "active" or row["local_status"] != "active":
            return None  # an inactive account's commits are not redistributed (nor its #sync)
        body = {"did": row["did"], "blocks": bytes(row["blocks"]), "rev": row["rev"], "time": _iso(now)}
        return PendingEvent(kind="#sync", did=row["did"], body=body)
    active, status = bool(row["active"]), row["status"]
    if row["local_status"] != "active":  # an operator takedown outranks what the host says
        active, status = False, row["local_status"]
    body = {"did": row["did"], "time": _iso(now), "active": active}
    if not active and status:
        body["status"] = status
    return PendingEvent(kind="#account", did=row["did"], body=body)


def _seq_of(result: Any) -> int | None:
    if isinstance(result, int):
        return result
    seq = getattr(result, "seq", None)
    return int(seq) if isinstance(seq, int) else None


async def drain_repair_outbox(store: Store, submit: Submit, limit: int = 500) -> int:
    """Submit up to ``limit`` pending repairs in outbox order through ``submit`` (the relay's single
    writer); returns how many were consumed. Each row is marked consumed after its submit resolved."""
    done = 0
    for row in await store.pending_repairs(limit):
        now = time.time()
        event = event_for(row, now)
        seq = _seq_of(await submit(event)) if event is not None else None
        await store.mark_repair_consumed(row["id"], now, seq)
        done += 1
    return done
