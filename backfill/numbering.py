"""Numbering one sequencer batch: pure bookkeeping, no I/O (``backfill.sequencer`` owns the rest).

``number_batch(items, heads, base=, now=, encode=)`` walks the queued items in order and decides,
for each: fenced off (its ``Fence`` was revoked: ``FencedOffError``), a cursor-only advance, a
re-delivery to ignore (its ``rev`` is not newer than the account's head: stored, or numbered
earlier in this batch), or the next seq after ``base`` with its wire frame (``encode(kind, body)``,
or ``seq`` spliced into a pre-encoded body). Per-event failures (seq space exhausted, a body the
encoder refuses) fail only that item and revoke its fence.

Event times are whole microseconds, one apart within a batch (``now`` rounded to a microsecond for
the first event, +1 µs for each next one): every event gets its own ``time_us``, which the JSON
stream uses as its cursor, and times never decrease along seq. ``Numbered.last_time`` is the time of
the last event numbered (``now`` if none); the next batch starts strictly after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backfill.collections import CollectionChanges
from backfill.errors import FencedOffError, SeqExhaustedError
from backfill.store import SEQ_LIMIT
from firehose.framing import frame_header, splice_seq
from firehose.state import AccountState, Fence, PendingEvent, SequencedEvent

FrameEncoder = Callable[[str, dict[str, Any]], bytes]


@dataclass(slots=True)
class CursorOnly:
    """Advance a host cursor with no event (e.g. after a rejected or ignored frame)."""

    host: str
    upstream_seq: int
    fence: Fence | None = None


@dataclass(slots=True)
class AccountWrite:
    """Store an account's state with no event (e.g. marked desynchronized, or held over its host's
    limit): the account lanes are the only writers of account rows, through the sequencer."""

    account: AccountState
    fence: Fence | None = None
    rev: None = None

    @property
    def did(self) -> str:
        return self.account.did


@dataclass(slots=True)
class Numbered:
    """The outcome of ``number_batch``: ``seq`` is the last seq given (``base`` if none)."""

    seq: int
    rows: list[tuple[int, str, str, float, bytes]] = field(default_factory=list)
    sequenced: list[SequencedEvent] = field(default_factory=list)
    results: list[tuple[asyncio.Future[Any], SequencedEvent | None]] = field(default_factory=list)
    errors: list[tuple[asyncio.Future[Any], BaseException]] = field(default_factory=list)
    accounts: dict[str, AccountState] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)
    revved: set[str] = field(default_factory=set)  # dids whose rev advanced in this batch
    last_rev: dict[str, str | None] = field(default_factory=dict)
    ignored: int = 0
    encode_errors: int = 0
    fenced: int = 0
    last_time: float = 0.0
    collections: CollectionChanges = field(default_factory=CollectionChanges)
    #: (host, upstream seq) of the #identity/#account events numbered here that a re-read of their
    #: host cannot recognise by a rev (``PendingEvent.frame_seq``)
    upstream_done: list[tuple[str, int]] = field(default_factory=list)


#: kinds whose re-delivery a rev does not reveal
_NO_REV_KINDS = ("#identity", "#account")


async def number_batch(
    items: list[tuple[Any, asyncio.Future[Any]]],
    heads: dict[str, tuple[str | None, str | None]],
    *,
    base: int,
    now: float,
    encode: FrameEncoder,
) -> Numbered:
    """See the module docstring. ``heads``: did → (host, rev) as stored or numbered before."""
    seq = base
    last_rev: dict[str, str | None] = {did: head[1] for did, head in heads.items()}
    rows: list[tuple[int, str, str, float, bytes]] = []
    sequenced: list[SequencedEvent] = []
    results: list[tuple[asyncio.Future[Any], SequencedEvent | None]] = []
    errors: list[tuple[asyncio.Future[Any], BaseException]] = []
    accounts: dict[str, AccountState] = {}
    cursors: dict[str, int] = {}
    revved: set[str] = set()
    ignored = encode_errors = 0
    fenced = 0
    now_us = round(now * 1_000_000)
    last_time = now
    collections = CollectionChanges()
    upstream_done: list[tuple[str, int]] = []
    for index, (item, fut) in enumerate(items):
        if index % 128 == 127:
            # Let the commit in flight keep streaming its COPY data while this batch encodes.
            await asyncio.sleep(0)
        fence = item.fence
        if fence is not None and not fence.valid:  # an earlier event of its run was not stored
            fenced += 1
            errors.append((fut, FencedOffError(f"not stored: {fence.reason}")))
            continue
        if isinstance(item, CursorOnly):
            cursors[item.host] = max(cursors.get(item.host, 0), item.upstream_seq)
            results.append((fut, None))
            continue
        if isinstance(item, AccountWrite):
            state = item.account
            if not state.updated_at:
                state.updated_at = now
            accounts[state.did] = state
            results.append((fut, None))
            continue
        event: PendingEvent = item
        did = event.did
        rev = event.rev
        upstream_seq = event.upstream_seq
        if upstream_seq is not None and event.host is not None:
            if upstream_seq > cursors.get(event.host, 0):
                cursors[event.host] = upstream_seq
        if rev is not None:
            previous = last_rev.get(did)
            if previous is not None and rev <= previous:
                ignored += 1
                results.append((fut, None))
                continue
        seq += 1
        if seq >= SEQ_LIMIT:
            seq -= 1
            if fence is not None:
                fence.revoke(SeqExhaustedError.reason)
            errors.append((fut, SeqExhaustedError("seq would reach 2**53")))
            continue
        kind = event.kind
        try:
            body_cbor = event.body_cbor
            if body_cbor is None:
                frame = encode(kind, {**event.body, "seq": seq})
            else:  # pre-encoded by the producer: splice seq in, no re-encoding
                frame = splice_seq(body_cbor, seq, frame_header(kind), event.seq_offset)
        except Exception as exc:  # a body the encoder refuses fails only its own submit (and run)
            seq -= 1
            encode_errors += 1
            if fence is not None:
                fence.revoke("encode_error")
            errors.append((fut, exc))
            continue
        if rev is not None:
            last_rev[did] = rev
            revved.add(did)
        collections.add(event)
        at = (now_us + seq - base - 1) / 1_000_000  # exact: round(at * 1e6) gives the integer back
        last_time = at
        rows.append((seq, did, kind, at, frame))
        done = SequencedEvent(seq, did, kind, at, frame)
        sequenced.append(done)
        results.append((fut, done))
        frame_seq = event.frame_seq
        if frame_seq is not None and event.host is not None and kind in _NO_REV_KINDS:
            upstream_done.append((event.host, frame_seq))
        account = event.account
        if account is not None:
            if not account.updated_at:
                account.updated_at = now
            accounts[account.did] = account
    return Numbered(seq, rows, sequenced, results, errors, accounts, cursors, revved, last_rev,
                    ignored, encode_errors, fenced, last_time, collections,
                    [(h, s) for h, s in upstream_done if s > cursors.get(h, 0)])
