"""A consumer library for a relay's ``subscribeRepos`` (an I/O edge, like ``firehose.subscriber``).

    async with RelayConsumer("ws://127.0.0.1:2470", cursor_store=FileCursorStore("cursor")) as events:
        async for ev in events:
            if ev.kind == "gap":          # the relay no longer had what we asked for
                ...                       # e.g. resync from listRepos / getRepo
            elif ev.kind == "#commit":
                ...
            events.done(ev)               # applied: may now count towards the saved cursor

* **Reconnects** with capped exponential backoff (``firehose.backoff``) with the last seq
  received as the cursor (cursors are exclusive, as every relay and PDS counts them: the stream
  resumes at ``seq > cursor``), and drops any event at or below the last one received (a resend,
  or a server that counts cursors inclusively), so every event is yielded once per process.
* ``#info OutdatedCursor`` becomes an explicit ``Event(kind="gap")`` (the relay skipped ahead to
  the start of its window); an error frame ``FutureCursor`` (our cursor is ahead of the relay:
  e.g. it lost its store) becomes ``Event(kind="future_cursor")``, after which the stream goes on
  live from the relay's present (seqs may then be lower than before).
* **Checkpoints**: handlers may run in parallel and finish in any order; :meth:`done` marks an
  event applied. The cursor saved (``cursor_store.save``, at most every ``save_interval`` seconds
  and on close) is the highest seq at or below which *every* received event has been applied
  — never the last one received — so a restart (which resumes after it) redelivers what was not
  applied (at least once; handlers should be idempotent). At most ``max_in_flight`` events are un-applied at once: the
  iterator waits (and stops reading the socket) beyond that.
* **Verification** (optional, ``signing_key=`` an async ``did -> did:key`` lookup): each
  ``#commit``/``#sync`` is judged by ``firehose.validate`` (signature, hashes, MST inversion,
  chaining to the previous commit seen for the account); ``Event.verdict`` carries the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from firehose.backoff import Backoff
from firehose.frames import FrameError, decode_frame
from firehose.lru import BoundedLRU
from firehose.state import AccountState
from firehose.validate import Verdict, validate_frame

log = logging.getLogger(__name__)

SUBSCRIBE_PATH = "/xrpc/com.atproto.sync.subscribeRepos"
KeyLookup = Callable[[str], Awaitable[str]]


class CursorStore(Protocol):
    """Where the consumer keeps its resume cursor (the last seq applied: the stream resumes after it)."""

    async def load(self) -> int | None: ...

    async def save(self, cursor: int) -> None: ...


class MemoryCursorStore:
    def __init__(self, cursor: int | None = None) -> None:
        self.cursor = cursor
        self.saves = 0

    async def load(self) -> int | None:
        return self.cursor

    async def save(self, cursor: int) -> None:
        self.cursor = cursor
        self.saves += 1


class FileCursorStore:
    """The cursor as decimal text in one file, replaced atomically (write, fsync, rename)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    async def load(self) -> int | None:
        try:
            return int(self.path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    async def save(self, cursor: int) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{cursor}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


@dataclass(slots=True)
class Event:
    """One stream event. ``kind`` is the frame type (``#commit``, ``#sync``, ``#identity``,
    ``#account``) or ``gap`` / ``future_cursor`` (then ``seq`` is the cursor that was asked for)."""

    kind: str
    seq: int
    did: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    raw: bytes = b""
    verdict: Verdict | None = None


class Checkpoint:
    """The contiguous-applied watermark over received seqs (ascending) applied in any order."""

    def __init__(self) -> None:
        self._pending: dict[int, None] = {}  # received, not applied, in receive (= seq) order
        self._last: int | None = None

    def received(self, seq: int) -> None:
        self._pending[seq] = None
        self._last = seq

    def applied(self, seq: int) -> None:
        self._pending.pop(seq, None)

    def reset(self) -> None:
        self._pending.clear()
        self._last = None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def watermark(self) -> int | None:
        """The highest seq at or below which every received event is applied (None: none yet)."""
        if self._pending:
            first = next(iter(self._pending))
            return first - 1 if self._last is not None and first - 1 >= 0 else None
        return self._last


class RelayConsumer:
    """See the module docstring. ``url``: the relay's base (``ws://host:port``) or the full
    subscribeRepos URL; ``cursor``: where to start when the store has none (None: live; 0: the
    whole window; N: every event after seq N)."""

    def __init__(self, url: str, *, cursor_store: CursorStore | None = None, cursor: int | None = None,
                 signing_key: KeyLookup | None = None, max_in_flight: int = 1000, save_interval: float = 1.0,
                 backoff: Backoff | None = None, max_frame_bytes: int = 5 * 1024 * 1024) -> None:
        self.url = url if SUBSCRIBE_PATH in url else url.rstrip("/") + SUBSCRIBE_PATH
        self.cursor_store = cursor_store or MemoryCursorStore()
        self.start_cursor = cursor
        self.signing_key = signing_key
        self.max_in_flight = max_in_flight
        self.save_interval = save_interval
        self.backoff = backoff or Backoff(0.25, 30.0)
        self.max_frame_bytes = max_frame_bytes
        self.checkpoint = Checkpoint()
        self.connections = 0
        self.duplicates_dropped = 0
        self._last: int | None = None
        self._saved: int | None = None
        self._saved_at = 0.0
        self._room = asyncio.Event()
        self._room.set()
        self._states: BoundedLRU[str, AccountState] = BoundedLRU(100_000)

    async def __aenter__(self) -> RelayConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.save()

    def done(self, event: Event) -> None:
        """Mark ``event`` applied (from any task, in any order)."""
        self.checkpoint.applied(event.seq)
        if self.checkpoint.in_flight < self.max_in_flight:
            self._room.set()

    async def save(self) -> None:
        """Save the checkpoint now (if it moved): the contiguous-applied watermark."""
        mark = self.checkpoint.watermark
        if mark is not None and mark != self._saved:
            await self.cursor_store.save(mark)
            self._saved = mark
        self._saved_at = time.monotonic()

    async def __aiter__(self) -> AsyncIterator[Event]:
        stored = await self.cursor_store.load()
        cursor = stored if stored is not None else self.start_cursor
        attempt = 0
        while True:
            url = self.url if cursor is None else f"{self.url}?cursor={cursor}"
            try:
                async with connect(url, max_size=self.max_frame_bytes) as ws:
                    self.connections += 1
                    attempt = 0
                    async for raw in ws:
                        if not isinstance(raw, bytes):
                            continue
                        event = self._event(raw, cursor)
                        if event is None:
                            continue
                        if event.kind == "future_cursor":
                            self._last = None
                            self.checkpoint.reset()
                            cursor = None
                            yield event
                            break  # the relay closes after the error; go on live
                        if event.kind != "gap":
                            await self._wait_for_room()
                            self.checkpoint.received(event.seq)
                            self._last = event.seq
                            cursor = event.seq
                        yield event
                        if time.monotonic() - self._saved_at >= self.save_interval:
                            await self.save()
            except (TimeoutError, OSError, ConnectionClosed, InvalidHandshake) as exc:
                log.info("relay connection lost: %s", type(exc).__name__)
            delay = self.backoff.next() if attempt else 0.0
            attempt += 1
            await asyncio.sleep(delay)

    async def _wait_for_room(self) -> None:
        while self.checkpoint.in_flight >= self.max_in_flight:
            self._room.clear()
            await self._room.wait()

    def _event(self, raw: bytes, cursor: int | None) -> Event | None:
        try:
            frame = decode_frame(raw, max_bytes=self.max_frame_bytes)
        except FrameError as exc:
            log.warning("undecodable frame skipped: %s", exc.reason)
            return None
        body = frame.body
        if frame.is_error:
            if body.get("error") == "FutureCursor":
                return Event("future_cursor", cursor or 0, body=body, raw=raw)
            raise ConnectionClosed(None, None)  # any other error frame: reconnect
        if frame.t == "#info":
            if body.get("name") == "OutdatedCursor":
                return Event("gap", cursor or 0, body=body, raw=raw)
            return None
        seq = body.get("seq")
        if not isinstance(seq, int) or frame.t is None:
            return None
        if self._last is not None and seq <= self._last:
            self.duplicates_dropped += 1
            return None
        did = body.get("repo") if frame.t == "#commit" else body.get("did")
        return Event(frame.t, seq, did if isinstance(did, str) else None, body, raw)

    async def verify(self, event: Event) -> Verdict | None:
        """Judge a ``#commit``/``#sync`` (with ``signing_key``), chaining on the account's last
        accepted state; sets and returns ``event.verdict``."""
        if self.signing_key is None or event.kind not in ("#commit", "#sync") or event.did is None:
            return None
        key = await self.signing_key(event.did)
        state = self._states.get(event.did)
        verdict = validate_frame(event.raw, state, key, time.time())
        if verdict.kind == "accept" and verdict.new_state is not None:
            self._states.put(event.did, verdict.new_state)
        event.verdict = verdict
        return verdict


async def verified(consumer: RelayConsumer) -> AsyncIterator[Event]:
    """``consumer``'s events with ``verdict`` set on every ``#commit``/``#sync``."""
    async for event in consumer:
        with contextlib.suppress(Exception):  # a key lookup failure leaves the verdict unset
            await consumer.verify(event)
        yield event
