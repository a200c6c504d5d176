"""Protocol value types: an account's state and the events that carry it (no I/O, no SQL).

``AccountState`` is what validation reads and returns and what an account lane owns in flight;
``PendingEvent`` is what a lane hands to the sequencer; ``SequencedEvent`` is what the store and
the bus hand to broadcasters. ``backfill`` stores them; it imports them from here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

#: Upstream account statuses (from ``#account`` / ``getRepoStatus``), plus "active".
UpstreamStatus = Literal[
    "active", "takendown", "suspended", "deactivated", "deleted", "desynchronized", "throttled"
]
#: Local (relay operator) status: an admin takedown overrides everything upstream says.
LocalStatus = Literal["active", "takendown"]
#: Where the relay's copy of the repository stands.
SyncState = Literal["synced", "desynchronized", "resyncing", "throttled"]
#: Event kinds as they appear in the frame header ``t``.
EventKind = Literal["#commit", "#sync", "#identity", "#account"]


@dataclass(slots=True)
class AccountState:
    """The relay's stored view of one account. CIDs are kept as their base32 strings."""

    did: str
    host: str | None = None
    upstream_status: str = "active"
    local_status: str = "active"
    rev: str | None = None
    commit_cid: str | None = None
    data_cid: str | None = None
    sync_state: str = "synced"
    updated_at: float = 0.0

    @property
    def active(self) -> bool:
        """True when events of this account may be redistributed."""
        return self.upstream_status == "active" and self.local_status == "active"

    @property
    def combined_status(self) -> str:
        """The status the relay reports downstream: a local takedown wins over upstream."""
        if self.local_status != "active":
            return self.local_status
        return self.upstream_status



#: ``AccountState`` as a plain tuple in field order, which is also the accounts table's column order in both
#: stores: one C-level call (rows for COPY/executemany, and the validation workers' pipe format).
account_row: Callable[[AccountState], tuple[Any, ...]] = operator.attrgetter(*(f.name for f in fields(AccountState)))

class Fence:
    """A revocable licence to be stored, shared by the events of one upstream run.

    The sequencer stores an event only while its fence is valid, and revokes the fence of every
    event it fails to store (synchronously, before it numbers anything else). So once one event
    of a run is lost to a failed write, no later event of that run — another commit of the same
    account chained on the lost one, or a later frame whose host cursor would skip past it — is
    stored either; the run is restarted from its durable cursor and re-reads them all.
    """

    __slots__ = ("reason", "valid")

    def __init__(self) -> None:
        self.valid = True
        self.reason = ""

    def revoke(self, reason: str) -> None:
        """Idempotent; keeps the first reason."""
        if self.valid:
            self.valid = False
            self.reason = reason

    def __repr__(self) -> str:
        return f"Fence(valid={self.valid}, reason={self.reason!r})"


OP_ACTIONS = ("create", "update", "delete")


def commit_op_changes(ops: object) -> tuple[tuple[str, str], ...]:
    """``(collection, action)`` of each well-formed op of a ``#commit``'s ``ops`` (a dict whose
    ``path`` names a collection and whose ``action`` is create/update/delete), in order; anything
    else is skipped. What ``backfill.collections`` counts."""
    if not isinstance(ops, list):
        return ()
    out: list[tuple[str, str]] = []
    for op in ops:
        if not isinstance(op, dict):
            continue
        collection = str(op.get("path", "")).partition("/")[0]
        action = op.get("action")
        if collection and action in OP_ACTIONS:
            out.append((collection, str(action)))
    return tuple(out)


@dataclass(slots=True)
class PendingEvent:
    """A verified event waiting for a ``seq``.

    ``body`` is the message body without ``seq``; the sequencer adds ``seq`` and encodes the
    frame exactly once. Alternatively ``body_cbor`` carries that body already encoded as
    canonical DAG-CBOR (without ``seq``), optionally with ``seq_offset``, the byte offset where
    the ``seq`` entry belongs (both from ``firehose.framing.encode_unsequenced``); the sequencer
    then splices ``seq`` into those bytes (``firehose.framing.splice_seq``) and does not read
    ``body`` (which may be left empty); the frame header is the standard ``{op: 1, t: kind}``,
    whatever ``frame_encoder`` the sequencer was given. ``account`` (when given) is the account state to persist in the same
    transaction. ``host``/``upstream_seq`` advance that host's upstream cursor in the same
    transaction. ``rev`` (with ``did``) identifies re-deliveries of an already sequenced commit.
    ``fence`` (optional): the event is stored only while it is valid (see ``Fence``).
    ``collections`` (optional): the account's complete record counts per collection at this event
    (a walk of the whole verified repository, e.g. a resync's ``#sync``); they replace the stored
    ones in the same transaction (``backfill.collections``).
    ``frame_seq`` (optional, with ``host``): the upstream seq of the frame this event came from;
    an ``#identity``/``#account`` stored above the cursor it carries (``upstream_seq``) is recorded
    as done there (``backfill.store.BatchWrite.upstream_done``), so a re-read skips it.
    ``op_changes`` (optional, ``#commit``): ``commit_op_changes`` of the body's ``ops``, computed
    where the body was decoded anyway (the validation worker), so the sequencer's collection
    bookkeeping need not decode ``body_cbor`` again; None: it reads the ops from the body.
    """

    kind: str
    did: str
    body: dict[str, Any]
    rev: str | None = None
    account: AccountState | None = None
    host: str | None = None
    upstream_seq: int | None = None
    body_cbor: bytes | None = None
    seq_offset: int | None = None
    fence: Fence | None = None
    collections: dict[str, int] | None = None
    frame_seq: int | None = None
    op_changes: tuple[tuple[str, str], ...] | None = None


@dataclass(slots=True)
class SequencedEvent:
    """A durable event: ``frame`` is the complete wire frame (header + body including seq)."""

    seq: int
    did: str
    kind: str
    time: float
    frame: bytes
    extra: dict[str, Any] = field(default_factory=dict)
