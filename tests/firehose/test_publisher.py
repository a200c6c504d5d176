"""``firehose.publisher.BusPublisher`` on its own, over the real in-process bus: the sequencer's
side never waits; batches reach the bus in seq order, coalesced; the byte bound drops the oldest
(counted); a failed bus call is retried with only what the bus does not hold; ``close`` drains
within its bound. (The publisher against a hung Redis: ``tests/faults/test_bus_hang.py``.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest
import redis.exceptions

from firehose.bus import InProcessBus
from firehose.publisher import EVENT_OVERHEAD, BusPublisher, batch_bytes, classify_bus_error
from firehose.state import SequencedEvent
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def ev(seq: int, size: int = 10) -> SequencedEvent:
    return SequencedEvent(seq, "did:plc:p", "#commit", 0.0, b"f" * size)


class GatedBus:
    """The real in-process bus behind a gate the test opens (``publish`` and ``head`` wait on it),
    recording every call; ``fail`` makes the next calls raise, before (``"before"``) or after
    (``"after"``) the events reached the bus, and close the gate."""

    def __init__(self) -> None:
        self.inner = InProcessBus(maxsize=10_000)
        self.sub = self.inner.subscribe()
        self.open = asyncio.Event()
        self.open.set()
        self.calls: list[list[int]] = []
        self.heads = 0
        self.fail: list[str] = []

    async def publish(self, events: Sequence[SequencedEvent]) -> None:
        self.calls.append([e.seq for e in events])
        await self.open.wait()
        mode = self.fail.pop(0) if self.fail else None
        if mode is not None:
            self.open.clear()
        if mode == "before":
            raise redis.exceptions.ConnectionError("refused")
        await self.inner.publish(events)
        if mode == "after":
            raise TimeoutError("the reply never came")

    async def head(self) -> int | None:
        self.heads += 1
        await self.open.wait()
        return self.inner.last_seq

    async def received(self) -> list[int]:
        seqs: list[int] = []
        while not self.sub._queue.empty():
            seqs += [e.seq for e in await self.sub.next_batch()]
        return seqs


async def test_batches_reach_the_bus_in_order_coalesced_up_to_max_events() -> None:
    bus = GatedBus()
    publisher = BusPublisher(bus, max_events=5)
    publisher.start()
    try:
        bus.open.clear()  # the first call is held: what comes meanwhile queues up
        await publisher.publish([ev(1)])
        await until(lambda: bus.calls == [[1]], "the first call")
        for seq in range(2, 9):
            publisher.offer([ev(seq)])
        publisher.offer([])  # nothing: not queued
        assert (publisher.stats.queued_events, publisher.stats.queued_bytes) == (8, 8 * (10 + EVENT_OVERHEAD))
        bus.open.set()
        await asyncio.wait_for(publisher.flushed(), 10)
        # 2..8 in two calls: 5 (max_events), then what is left; never more than max_events
        assert bus.calls == [[1], [2, 3, 4, 5, 6], [7, 8]]
        assert await bus.received() == list(range(1, 9))
        assert (publisher.stats.published, publisher.stats.dropped, publisher.stats.errors) == (8, 0, 0)
        assert (publisher.stats.queued_events, publisher.stats.queued_bytes) == (0, 0)
        # a batch larger than max_events is published whole; a batch that would pass it waits
        bus.open.clear()
        publisher.offer([ev(9)])
        await until(lambda: len(bus.calls) == 4, "the held call")
        publisher.offer([ev(s) for s in range(10, 17)])
        publisher.offer([ev(17)])
        bus.open.set()
        await asyncio.wait_for(publisher.flushed(), 10)
        assert bus.calls[3:] == [[9], list(range(10, 17)), [17]]
    finally:
        await publisher.close()


async def test_a_full_queue_drops_its_oldest_batches_and_keeps_the_newest() -> None:
    """The bound counts every batch not yet through, the one being published included; a batch
    that does not fit drops the oldest queued ones (counted), and the newest is always kept."""
    bus = GatedBus()
    per_event = batch_bytes([ev(1)])
    publisher = BusPublisher(bus, max_bytes=3 * per_event)
    publisher.start()
    try:
        bus.open.clear()
        publisher.offer([ev(1)])
        await until(lambda: bus.calls == [[1]], "event 1 being published")
        publisher.offer([ev(2)])
        publisher.offer([ev(3)])  # exactly at the bound: nothing dropped
        assert (publisher.stats.dropped, publisher.stats.queued_bytes) == (0, 3 * per_event)
        publisher.offer([ev(4)])  # does not fit: the oldest queued batch (2) goes
        assert (publisher.stats.dropped, publisher.stats.queued_events) == (1, 3)
        big = ev(5, size=4 * per_event)
        publisher.offer([big])  # larger than the bound: every queued batch goes, it is kept
        assert (publisher.stats.dropped, publisher.stats.queued_events) == (3, 2)
        assert publisher.stats.queued_bytes == per_event + batch_bytes([big])
        bus.open.set()
        await asyncio.wait_for(publisher.flushed(), 10)
        assert await bus.received() == [1, 5]
        assert (publisher.stats.published, publisher.stats.queued_events, publisher.stats.queued_bytes) == (2, 0, 0)
    finally:
        await publisher.close()


@pytest.mark.parametrize("mode", ["before", "after"])
async def test_a_failed_call_is_retried_with_only_what_the_bus_lacks(mode: str) -> None:
    """A call that failed before reaching the bus is made again whole; one that failed after (the
    reply lost) is not made again: the bus's head says it has the events. Nothing twice, no hole."""
    bus = GatedBus()
    publisher = BusPublisher(bus, retry_base=0.001, retry_max=0.001)
    publisher.start()
    try:
        await publisher.publish([ev(1), ev(2)])
        await asyncio.wait_for(publisher.flushed(), 10)
        assert publisher.failing is None and bus.heads == 0  # no failure: the head is not asked
        bus.fail = [mode]  # the failing call closes the gate: the retry waits for the test
        publisher.offer([ev(3), ev(4)])
        await until(lambda: publisher.failing is not None, "the failure noted")
        assert classify_bus_error(publisher.failing) == ("bus_unreachable" if mode == "before" else "bus_hung")
        assert publisher.stats.errors == 1
        bus.open.set()
        await asyncio.wait_for(publisher.flushed(), 10)
        assert await bus.received() == [1, 2, 3, 4]
        assert bus.calls == ([[1, 2], [3, 4], [3, 4]] if mode == "before" else [[1, 2], [3, 4]])
        assert publisher.failing is None and bus.heads == 1 and publisher.stats.errors == 1
        assert publisher.stats.published == (4 if mode == "before" else 2)  # (a lost reply: not counted)
        # working again: the next batch goes straight out, without asking the head
        publisher.offer([ev(5)])
        await asyncio.wait_for(publisher.flushed(), 10)
        assert bus.calls[-1] == [5] and bus.heads == 1
    finally:
        await publisher.close()


async def test_a_call_that_hangs_is_bounded_by_the_timeout() -> None:
    bus = GatedBus()
    publisher = BusPublisher(bus, timeout=0.05, retry_base=0.001, retry_max=0.001)
    publisher.start()
    try:
        bus.open.clear()  # hangs until opened
        publisher.offer([ev(1)])
        await until(lambda: publisher.stats.errors >= 2, "two calls timed out")
        assert isinstance(publisher.failing, TimeoutError)
        bus.open.set()
        await asyncio.wait_for(publisher.flushed(), 10)
        assert await bus.received() == [1] and publisher.failing is None
    finally:
        await publisher.close()


async def test_close_drains_what_is_queued_then_drops_the_rest() -> None:
    bus = GatedBus()
    publisher = BusPublisher(bus)
    publisher.start()
    publisher.offer([ev(1)])
    publisher.offer([ev(2)])
    await publisher.close()  # drained: everything published
    assert await bus.received() == [1, 2] and publisher.stats.dropped == 0
    await publisher.close()  # idempotent

    hung = GatedBus()
    hung.open.clear()
    publisher = BusPublisher(hung, drain_timeout=0.05)
    publisher.start()
    publisher.offer([ev(1)])
    await until(lambda: hung.calls == [[1]], "the hung call")
    publisher.offer([ev(2), ev(3)])
    await publisher.close()
    assert publisher.stats.dropped == 2 and (publisher.stats.queued_events, publisher.stats.queued_bytes) == (0, 0)
    assert publisher.stats.published == 0


def test_bus_errors_are_classified() -> None:
    assert classify_bus_error(TimeoutError()) == "bus_hung"
    assert classify_bus_error(redis.exceptions.TimeoutError()) == "bus_hung"
    assert classify_bus_error(redis.exceptions.ConnectionError()) == "bus_unreachable"
    assert classify_bus_error(ConnectionRefusedError()) == "bus_unreachable"
    assert classify_bus_error(redis.exceptions.ResponseError("ERR")) == "bus_error"
    for bad in ({"max_bytes": 0}, {"max_events": 0}, {"timeout": 0}):
        with pytest.raises(ValueError, match="^max_bytes, max_events and timeout must be positive$"):
            BusPublisher(GatedBus(), **bad)
    smallest = BusPublisher(GatedBus(), max_bytes=1, max_events=1, timeout=0.001)  # the least that is positive
    assert (smallest.max_bytes, smallest.max_events, smallest.timeout) == (1, 1, 0.001)
    default = BusPublisher(GatedBus())  # the defaults the relay runs with (it sets max_bytes and timeout)
    assert (default.max_bytes, default.max_events, default.timeout, default.retry_base, default.retry_max,
            default.drain_timeout) == (64 * 1024 * 1024, 2000, 5.0, 0.05, 2.0, 5.0)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[tuple[str, object]]:
    """The publisher's warnings so far, as ``(message, events field)``."""
    return [(r.getMessage(), getattr(r, "events", None)) for r in caplog.records
            if r.name == "firehose.publisher" and r.levelno == logging.WARNING]


QUEUE_FULL = "bus publisher: queue full; dropping the oldest unpublished events (fan-outs read them from the store)"
CLOSED = "bus publisher: closed with events unpublished (fan-outs read them from the store)"


async def test_drops_log_once_per_run_and_close_adds_what_it_drops(caplog: pytest.LogCaptureFixture) -> None:
    """One warning per run of drops (with the events of the first drop), again only after a publish
    succeeded; ``close`` adds the events it drops to the ones dropped before and logs them; a
    second ``close`` does nothing (it does not wait for the drain again)."""
    caplog.set_level(logging.WARNING, logger="firehose.publisher")
    bus = GatedBus()
    per_event = batch_bytes([ev(1)])
    publisher = BusPublisher(bus, max_bytes=2 * per_event, drain_timeout=0.05)
    publisher.start()
    bus.open.clear()
    publisher.offer([ev(1)])
    await until(lambda: bus.calls == [[1]], "event 1 being published")
    publisher.offer([ev(2)])
    publisher.offer([ev(3), ev(4)])  # 2 is dropped: logged
    publisher.offer([ev(5)])  # 3 and 4 are dropped: the same run, not logged again
    assert publisher.stats.dropped == 3
    assert warnings_of(caplog) == [(QUEUE_FULL, 1)]
    bus.open.set()
    await asyncio.wait_for(publisher.flushed(), 10)
    assert await bus.received() == [1, 5]
    bus.open.clear()  # a publish succeeded: the next run of drops is logged again
    publisher.offer([ev(6)])
    await until(lambda: bus.calls[-1] == [6], "event 6 being published")
    publisher.offer([ev(7)])
    publisher.offer([ev(8), ev(9)])
    assert publisher.stats.dropped == 4
    assert warnings_of(caplog) == [(QUEUE_FULL, 1), (QUEUE_FULL, 1)]
    await publisher.close()  # 8 and 9 queued behind the hung call: dropped, added to the 4
    assert publisher.stats.dropped == 6
    assert warnings_of(caplog) == [(QUEUE_FULL, 1), (QUEUE_FULL, 1), (CLOSED, 2)]
    publisher.drain_timeout = 3600.0  # a second close would wait this long for a drain
    await asyncio.wait_for(publisher.close(), 10)
    assert publisher.stats.dropped == 6 and len(warnings_of(caplog)) == 3


class FlakyBus:
    """The real in-process bus; each call of ``publish`` first raises the next of ``failures``."""

    def __init__(self) -> None:
        self.inner = InProcessBus(maxsize=10_000)
        self.failures: list[Exception] = []

    async def publish(self, events: Sequence[SequencedEvent]) -> None:
        if self.failures:
            raise self.failures.pop(0)
        await self.inner.publish(events)

    async def head(self) -> int | None:
        return self.inner.last_seq


def outage_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, object]]]:
    """The publisher's warnings with their structured fields."""
    fields = ("error", "cause", "failed_attempts", "events")
    return [(r.getMessage(), {f: getattr(r, f) for f in fields if hasattr(r, f)}) for r in caplog.records
            if r.name == "firehose.publisher" and r.levelno == logging.WARNING]


FAILED = "bus publish failed; retrying (fan-outs follow the store meanwhile)"
AGAIN = "bus publishing works again"


async def test_an_outage_logs_its_start_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    """One line when an outage starts (the first error, cut to 300 characters, and its cause) and
    one when publishing works again (how many attempts failed); nothing for a publish that works;
    the count starts again at the next outage."""
    caplog.set_level(logging.WARNING, logger="firehose.publisher")
    bus = FlakyBus()
    publisher = BusPublisher(bus, retry_base=0.001, retry_max=0.001)
    publisher.start()
    try:
        long = "x" * 400
        bus.failures = [redis.exceptions.ConnectionError(long), TimeoutError(), redis.exceptions.ResponseError("ERR")]
        publisher.offer([ev(1)])
        await asyncio.wait_for(publisher.flushed(), 10)
        assert outage_lines(caplog) == [
            (FAILED, {"error": f"ConnectionError: {long}"[:300], "cause": "bus_unreachable"}),
            (AGAIN, {"failed_attempts": 3}),
        ]
        assert publisher.stats.errors == 3 and publisher.failing is None
        publisher.offer([ev(2)])  # works at once: no line
        await asyncio.wait_for(publisher.flushed(), 10)
        assert len(outage_lines(caplog)) == 2
        bus.failures = [TimeoutError("slow")]
        publisher.offer([ev(3)])
        await asyncio.wait_for(publisher.flushed(), 10)
        assert outage_lines(caplog)[2:] == [
            (FAILED, {"error": "TimeoutError: slow", "cause": "bus_hung"}),
            (AGAIN, {"failed_attempts": 1}),
        ]
        assert bus.inner.last_seq == 3 and publisher.stats.published == 3
    finally:
        await publisher.close()
