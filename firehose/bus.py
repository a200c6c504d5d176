"""Event bus between the sequencer (publisher) and broadcasters (subscribers).

Contract: ``publish(events)`` is called by the single sequencer *after* the events are durable,
with strictly increasing ``seq``. A :class:`Subscription` yields every event published after its
position, in ``seq`` order, in batches. Frames travel as the stored bytes (never re-encoded).

* :class:`InProcessBus` — embedded mode; bounded queues, a slow subscriber back-pressures
  ``publish`` (the broadcaster never is slow: it only moves references into per-consumer queues).
* :class:`RedisStreamBus` — scale-out mode; one Redis Stream whose entry IDs are ``<seq>-0``,
  so a subscription can be positioned exactly *after a seq* without a round trip. Each entry
  records the previous seq this publisher published (``prev``, ``extra["prev_seq"]``), kept for
  diagnosis only: a bus may lose entries (a failed publish, a publisher that died between its
  commit and its publish, a Redis restart, a trim), so readers must not rely on it —
  ``firehose.broadcast`` finds holes by seq contiguity and fills them from the store.

Every Redis client the relay opens comes from :func:`redis_client`: explicit connect and socket
timeouts, a health check of idle connections and no hidden retries (redis-py would otherwise retry a
timed-out command three times: a hung Redis would hold each call for several timeouts). Callers
retry on their own terms (``firehose.publisher``, ``firehose.broadcast``).

``head()`` tells the last seq the bus holds (the publisher asks after a failed publish, which may
or may not have reached the bus, so that nothing is published twice).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT, FieldT

from firehose.state import SequencedEvent


class Subscription(Protocol):
    """An ordered feed of events published after the subscription's position."""

    async def next_batch(self) -> list[SequencedEvent]:
        """Wait for and return the next non-empty batch (raises ``BusClosed`` once closed)."""
        ...

    async def close(self) -> None: ...


class EventBus(Protocol):
    async def publish(self, events: Sequence[SequencedEvent]) -> None: ...

    def subscribe(self, after_seq: int | None = None) -> Subscription:
        """Subscribe to events with ``seq > after_seq`` (``None``: everything published from now)."""
        ...

    async def close(self) -> None: ...


class BusClosed(Exception):
    """The bus or the subscription was closed."""


class _InProcessSubscription:
    def __init__(self, bus: InProcessBus, after_seq: int | None, maxsize: int) -> None:
        self._bus = bus
        self._after = after_seq
        self._queue: asyncio.Queue[list[SequencedEvent] | None] = asyncio.Queue(maxsize)
        self._closed = False

    async def _put(self, batch: list[SequencedEvent]) -> None:
        if self._after is not None:
            batch = [e for e in batch if e.seq > self._after]
            if not batch:
                return
        await self._queue.put(batch)

    async def next_batch(self) -> list[SequencedEvent]:
        if self._closed and self._queue.empty():
            raise BusClosed()
        batch = await self._queue.get()
        if batch is None:
            self._closed = True
            raise BusClosed()
        return batch

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bus._subs.discard(self)
            try:
                self._queue.put_nowait(None)
            except asyncio.QueueFull:
                pass


class InProcessBus:
    """In-process fan-out to subscriptions; bounded (``maxsize`` batches per subscription)."""

    def __init__(self, maxsize: int = 1024) -> None:
        self._subs: set[_InProcessSubscription] = set()
        self._maxsize = maxsize
        self.last_seq: int | None = None

    async def publish(self, events: Sequence[SequencedEvent]) -> None:
        if not events:
            return
        batch = list(events)
        self.last_seq = batch[-1].seq
        for sub in list(self._subs):
            await sub._put(batch)

    async def head(self) -> int | None:
        return self.last_seq

    def subscribe(self, after_seq: int | None = None) -> _InProcessSubscription:
        sub = _InProcessSubscription(self, after_seq, self._maxsize)
        self._subs.add(sub)
        return sub

    async def close(self) -> None:
        for sub in list(self._subs):
            await sub.close()


@dataclass(frozen=True, slots=True)
class RedisTimeouts:
    """Bounds on every wait of a Redis client (seconds): ``connect`` a connection, ``socket`` one
    command's reply, ``health_check`` — an idle connection older than this is PINGed before use."""

    connect: float = 2.0
    socket: float = 2.0
    health_check: float = 30.0


def redis_client(url: str, timeouts: RedisTimeouts | None = None, *, decode_responses: bool = False) -> Any:
    """A ``redis.asyncio`` client bounded by ``timeouts`` (default :class:`RedisTimeouts`), without
    redis-py's own retries (a command that times out raises ``redis.TimeoutError`` after
    ``timeouts.socket``, once)."""
    t = timeouts or RedisTimeouts()
    return aioredis.from_url(url, decode_responses=decode_responses, socket_connect_timeout=t.connect,
                             socket_timeout=t.socket, health_check_interval=t.health_check,
                             retry=Retry(NoBackoff(), 0))


#: One stream entry as this bus's client returns it (``decode_responses=False``, RESP2): ``(id, fields)``.
_Entry = tuple[bytes, dict[bytes, bytes]]


class _RedisSubscription:
    def __init__(self, bus: RedisStreamBus, after_seq: int | None) -> None:
        self._bus = bus
        self._last_id: str | None = None if after_seq is None else f"{after_seq}-0"
        self._closed = False

    async def _position(self) -> str:
        if self._last_id is None:
            newest = cast("list[_Entry]", await self._bus.redis.xrevrange(self._bus.stream, count=1))
            self._last_id = newest[0][0].decode() if newest else "0-0"
        return self._last_id

    async def next_batch(self) -> list[SequencedEvent]:
        last = await self._position()
        while True:
            if self._closed:
                raise BusClosed()
            reply = cast(
                "list[tuple[bytes, list[_Entry]]]",  # RESP2 XREAD: [(stream, entries)]
                await self._bus.redis.xread(
                    {self._bus.stream: last}, count=self._bus.read_count, block=self._bus.block_ms
                ),
            )
            if not reply:
                continue
            entries = reply[0][1]
            batch = [_decode_entry(fields) for _, fields in entries]
            self._last_id = last = entries[-1][0].decode()
            if batch:
                return batch

    async def close(self) -> None:
        self._closed = True


def _decode_entry(fields: dict[bytes, bytes]) -> SequencedEvent:
    prev = fields.get(b"prev", b"")
    return SequencedEvent(
        seq=int(fields[b"seq"]),
        did=fields[b"did"].decode(),
        kind=fields[b"kind"].decode(),
        time=float(fields[b"time"]),
        frame=fields[b"frame"],
        extra={"prev_seq": int(prev)} if prev else {},
    )


class RedisStreamBus:
    """Redis Streams bus. Entry ID ``<seq>-0``; ``maxlen`` bounds the stream (approximate trim).
    Every command is bounded by ``timeouts`` (see :func:`redis_client`); a subscription's blocking
    read waits at most half the socket timeout (``block_ms`` is lowered to that), so an idle stream
    is never mistaken for a hung Redis."""

    def __init__(
        self,
        url: str,
        stream: str = "relay:events",
        *,
        maxlen: int = 200_000,
        block_ms: int = 1000,
        read_count: int = 512,
        approximate_trim: bool = True,
        timeouts: RedisTimeouts | None = None,
    ) -> None:
        self.timeouts = timeouts or RedisTimeouts()
        self.redis = redis_client(url, self.timeouts)
        self.stream = stream
        self.maxlen = maxlen
        self.block_ms = max(1, min(block_ms, int(self.timeouts.socket * 500)))
        self.read_count = read_count
        self.approximate_trim = approximate_trim
        self._last_published: int | None = None

    async def publish(self, events: Sequence[SequencedEvent]) -> None:
        if not events:
            return
        pipe = self.redis.pipeline(transaction=False)
        prev = self._last_published
        for e in events:
            fields: dict[FieldT, EncodableT] = {
                "seq": str(e.seq),
                "did": e.did,
                "kind": e.kind,
                "time": repr(e.time),
                "frame": e.frame,
                "prev": "" if prev is None else str(prev),
            }
            pipe.xadd(self.stream, fields, id=f"{e.seq}-0", maxlen=self.maxlen, approximate=self.approximate_trim)
            prev = e.seq
        await pipe.execute()
        self._last_published = prev

    async def head(self) -> int | None:
        newest = cast("list[_Entry]", await self.redis.xrevrange(self.stream, count=1))
        return int(newest[0][0].split(b"-")[0]) if newest else None

    def subscribe(self, after_seq: int | None = None) -> _RedisSubscription:
        return _RedisSubscription(self, after_seq)

    async def close(self) -> None:
        await self.redis.aclose()
