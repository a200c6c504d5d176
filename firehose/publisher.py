"""Publishing committed events to the bus, off the durable path.

``BusPublisher(bus)`` sits between the sequencer and the bus. The sequencer hands it each committed
batch (:meth:`BusPublisher.publish`: never waits, never raises) and goes on sequencing; the
publisher's own task hands the batches to the bus in seq order, one bus call at a time, queued
batches coalesced (up to ``max_events`` per call). So a hung, slow or dead bus costs fan-outs
latency, never ingest throughput.

Bounds:

* **Bytes.** The queue holds at most ``max_bytes`` (frame bytes plus ``EVENT_OVERHEAD`` per
  event), plus the batch being published and the newest batch offered (always kept). When a batch
  does not fit, the oldest queued batches are dropped and counted (``stats.dropped``). They are
  durable already: a fan-out finds the hole by seq contiguity and reads it from the store
  (``firehose.broadcast``), so a drop costs consumers latency, never events, and no consumer ever
  receives past a hole.
* **Time.** Each bus call is bounded by ``timeout`` seconds (the bus client has its own socket
  timeouts too). A call that fails or times out may or may not have reached the bus: before trying
  again (capped backoff, ``retry_base`` doubling to ``retry_max``) the publisher asks the bus for
  its head (``head()``) and publishes only what lies beyond it — nothing twice, nothing skipped
  that it still holds.

``failing`` is the error of the current outage (None once a publish succeeds again): readiness
names it (``classify_bus_error``). ``close()`` publishes what is queued for at most
``drain_timeout`` seconds, then drops the rest (counted; fan-outs read it from the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.exceptions as redis_errors

from firehose.backoff import backoff_delay
from firehose.state import SequencedEvent

log = logging.getLogger(__name__)

#: Bytes counted per queued event besides its frame (the event object, its fields, the list slot).
EVENT_OVERHEAD = 200


class PublishTarget(Protocol):
    """What the publisher needs of a bus (``firehose.bus.InProcessBus``, ``RedisStreamBus``)."""

    async def publish(self, events: Sequence[SequencedEvent]) -> None: ...

    async def head(self) -> int | None: ...


@dataclass(slots=True)
class PublisherStats:
    """Counters exposed for metrics (events, except ``errors``: failed or timed-out bus calls)."""

    published: int = 0
    dropped: int = 0
    errors: int = 0
    queued_bytes: int = 0
    queued_events: int = 0


def batch_bytes(events: Sequence[SequencedEvent]) -> int:
    """The bytes a batch is counted for in the publisher's budget."""
    return sum(len(e.frame) for e in events) + EVENT_OVERHEAD * len(events)


def classify_bus_error(exc: BaseException) -> str:
    """A short cause for readiness and logs: ``bus_hung`` (a call timed out: the server accepts
    connections but does not answer), ``bus_unreachable`` (connection refused or lost),
    ``bus_error`` (anything else, e.g. an error reply)."""
    if isinstance(exc, (TimeoutError, redis_errors.TimeoutError)):
        return "bus_hung"
    if isinstance(exc, (redis_errors.ConnectionError, OSError)):
        return "bus_unreachable"
    return "bus_error"


class BusPublisher:
    """See the module docstring. ``start()`` before the first batch; ``close()`` at the end."""

    def __init__(
        self,
        bus: PublishTarget,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        max_events: int = 2000,
        timeout: float = 5.0,
        retry_base: float = 0.05,
        retry_max: float = 2.0,
        drain_timeout: float = 5.0,
    ) -> None:
        if max_bytes <= 0 or max_events <= 0 or timeout <= 0:
            raise ValueError("max_bytes, max_events and timeout must be positive")
        self.bus = bus
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.timeout = timeout
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.drain_timeout = drain_timeout
        self.stats = PublisherStats()
        #: the error of the current bus outage (None while publishing works)
        self.failing: BaseException | None = None
        self._queue: deque[tuple[list[SequencedEvent], int]] = deque()
        self._has_items = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._attempts = 0
        self._drop_logged = False  # one log line per run of drops

    # -- the sequencer's side ----------------------------------------------------------------
    async def publish(self, events: list[SequencedEvent]) -> None:
        """The sequencer's ``publish``: queue ``events`` (ascending seq, after everything queued
        before) and return at once. Same as :meth:`offer`."""
        self.offer(events)

    def offer(self, events: Sequence[SequencedEvent]) -> None:
        """Queue a committed batch; drop the oldest queued batches when it does not fit."""
        if not events:
            return
        batch = list(events)
        size = batch_bytes(batch)
        stats = self.stats
        while self._queue and stats.queued_bytes + size > self.max_bytes:
            old, old_size = self._queue.popleft()
            self._forget(len(old), old_size)
            stats.dropped += len(old)
            if not self._drop_logged:
                self._drop_logged = True
                log.warning("bus publisher: queue full; dropping the oldest unpublished events "
                            "(fan-outs read them from the store)", extra={"events": len(old)})
        self._queue.append((batch, size))
        stats.queued_bytes += size
        stats.queued_events += len(batch)
        self._idle.clear()
        self._has_items.set()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="bus-publisher")

    async def flushed(self) -> None:
        """Wait until everything offered so far was published or dropped (tests, shutdown)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Publish what is queued for at most ``drain_timeout`` s, then stop (idempotent)."""
        if self._closing:
            return
        self._closing = True
        task = self._task
        if task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._idle.wait()), self.drain_timeout)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        left = self.stats.queued_events
        if left:
            self.stats.dropped += left
            log.warning("bus publisher: closed with events unpublished (fan-outs read them from the store)",
                        extra={"events": left})
            self._queue.clear()
            self._forget(left, self.stats.queued_bytes)

    # -- the publishing task -----------------------------------------------------------------
    def _forget(self, events: int, size: int) -> None:
        self.stats.queued_events -= events
        self.stats.queued_bytes -= size

    def _take(self) -> tuple[list[SequencedEvent], int]:
        """Queued batches, oldest first, coalesced up to ``max_events`` events (at least one batch)."""
        events, size = self._queue.popleft()
        while self._queue and len(events) + len(self._queue[0][0]) <= self.max_events:
            more, more_size = self._queue.popleft()
            events = events + more
            size += more_size
        return events, size

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._has_items.clear()
                await self._has_items.wait()
                continue
            events, size = self._take()
            try:
                await self._publish_until_done(events)
            finally:
                self._forget(len(events), size)

    async def _publish_until_done(self, events: list[SequencedEvent]) -> None:
        """Publish ``events``; after a failure, only what the bus does not hold yet."""
        while events:
            try:
                if self.failing is not None:
                    head = await asyncio.wait_for(self.bus.head(), self.timeout)
                    if head is not None:
                        events = [e for e in events if e.seq > head]
                        if not events:
                            break
                await asyncio.wait_for(self.bus.publish(events), self.timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every bus failure is retried; none is fatal
                self.stats.errors += 1
                if self.failing is None:
                    log.warning("bus publish failed; retrying (fan-outs follow the store meanwhile)",
                                extra={"error": f"{type(exc).__name__}: {exc}"[:300],
                                       "cause": classify_bus_error(exc)})
                self.failing = exc
                self._attempts += 1
                await asyncio.sleep(backoff_delay(self._attempts - 1, self.retry_base, self.retry_max))
                continue
            self.stats.published += len(events)
            break
        if self.failing is not None:
            log.warning("bus publishing works again", extra={"failed_attempts": self._attempts})
        self.failing = None
        self._attempts = 0
        self._drop_logged = False
