"""The relay side of the repair outbox: turn queued repairs into sequenced ``#sync``/``#account``.

The Spark jobs never write events themselves (the sequencer is the single writer). They queue
rows in ``spark_repair_outbox``; the running relay calls

    await drain_repair_outbox(db_url, sequencer.submit)

periodically (or after a job finishes). Each pending row becomes one ``PendingEvent`` (see
``event_for``); after ``submit`` resolves, the row is marked consumed with the assigned ``seq``. Delivery is at-least-once: a crash
between the two steps re-emits the same ``#sync`` (same rev), which consumers treat as a no-op.

No PySpark import here: the relay imports this module cheaply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from backfill.types import PendingEvent

Submit = Callable[[PendingEvent], Awaitable[Any]]

PENDING_SQL = (
    "SELECT o.id, o.kind, o.did, o.rev, o.blocks, o.active, o.status, a.upstream_status, a.local_status "
    "FROM spark_repair_outbox o LEFT JOIN accounts a ON a.did = o.did "
    "WHERE o.consumed_at IS NULL ORDER BY o.id LIMIT ?"
)
DONE_SQL = "UPDATE spark_repair_outbox SET consumed_at = ?, seq = ? WHERE id = ?"


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


async def drain_repair_outbox(db_url: str | None, submit: Submit, limit: int = 500) -> int:
    """Submit up to ``limit`` pending repairs in outbox order; returns how many were consumed
    (``db_url`` None → the embedded default database, as for ``backfill.store.open_store``)."""
    from spark.db import connect_db

    # One thread owns the connection for its whole life: sqlite3 connections (and the private
    # event loop of the PostgreSQL wrapper) must not move between threads.
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="repair-outbox") as owner:

        def on_owner(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return loop.run_in_executor(owner, fn, *args)

        db = await on_owner(connect_db, db_url)
        try:
            rows = await on_owner(db.fetch, PENDING_SQL, limit)
            done = 0
            for row in rows:
                now = time.time()
                event = event_for(row, now)
                seq = _seq_of(await submit(event)) if event is not None else None
                await on_owner(db.execute, DONE_SQL, now, seq, row["id"])
                done += 1
            return done
        finally:
            await on_owner(db.close)
