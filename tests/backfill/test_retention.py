"""Retention (trim by age and by size) and readers running while the sequencer and the trimmer
write, on both backends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from backfill.sequencer import Sequencer
from backfill.sql_store import SqlStore
from backfill.store import Store, retention_prefix
from firehose.state import SequencedEvent
from tests.backfill.helpers import Collector, commit_event
from tests.waiting import until


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_retention_prefix() -> None:
    rows = [(1, 10.0, 100), (2, 11.0, 100), (3, 12.0, 100), (4, 13.0, 100)]
    assert retention_prefix(rows, 11.5, 0) == (2, 200)
    assert retention_prefix(rows, None, 150) == (2, 200)
    assert retention_prefix(rows, 10.5, 250) == (3, 300)
    assert retention_prefix(rows, 0.0, 0) == (0, 0)
    assert retention_prefix([], 99.0, 99) == (0, 0)
    assert retention_prefix(rows, 11.0, 0) == (1, 100)  # a row exactly at the cutoff is not older: kept
    assert retention_prefix(rows, None, 200) == (2, 200)  # the bytes stop once the excess is freed


async def test_trim_by_age_keeps_window_and_high_water(store: Store) -> None:
    clock = FakeClock(1_000_000.0)
    async with Sequencer(store, Collector(), clock=clock, max_delay=0) as seq:
        for n in range(1, 31):
            clock.t = 1_000_000.0 + n * 60  # one event a minute
            await seq.submit(commit_event(n))
    before = await store.events_bytes()
    # Keep the last 10 minutes at t = 1_000_000 + 30.5 min: events 21..30 are younger.
    deleted = await store.trim(older_than_seconds=600, batch=4, now=1_000_000.0 + 30 * 60 + 30)
    assert deleted == 20
    events = await store.read_after(0, 100)
    assert [e.seq for e in events] == list(range(21, 31))
    assert await store.oldest_seq() == 21
    assert await store.latest_seq() == 30
    assert await store.events_bytes() == sum(len(e.frame) for e in events) < before
    assert await store.trim(older_than_seconds=600, now=1_000_000.0 + 30 * 60 + 30) == 0


async def test_trim_by_size(store: Store) -> None:
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 21):
            await seq.submit(commit_event(n, pad=1000))
    sizes = [len(e.frame) for e in await store.read_after(0, 100)]
    limit = sum(sizes[-7:])  # room for exactly the newest 7
    deleted = await store.trim(max_bytes=limit, batch=5)
    assert deleted == 13
    assert [e.seq for e in await store.read_after(0, 100)] == list(range(14, 21))
    assert await store.events_bytes() == limit
    assert await store.trim(max_bytes=limit) == 0  # exactly at the limit: nothing is over it
    assert await store.trim(older_than_seconds=None, max_bytes=None) == 0


async def test_a_trim_step_takes_at_most_a_batch_of_the_oldest(store: Store) -> None:
    """One step of ``trim`` is one short transaction over the oldest ``batch`` events only, even
    when more of them are due; the byte counter drops by exactly what it deleted."""
    assert isinstance(store, SqlStore)
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 6):
            await seq.submit(commit_event(n))
    assert await store._trim_step(2, cutoff=1e12, max_bytes=None) == 2  # all five are older than the cutoff
    left = await store.read_after(0, 100)
    assert [e.seq for e in left] == [3, 4, 5]
    assert await store.events_bytes() == sum(len(e.frame) for e in left)


async def test_trim_resets_byte_counter_when_window_emptied_externally(target, store: Store) -> None:
    async with Sequencer(store, Collector()) as seq:
        await seq.submit(commit_event(1))
    await target.sql("DELETE FROM events")
    assert await store.events_bytes() > 0
    assert await store.trim(max_bytes=10) == 0
    assert await store.events_bytes() == 0


async def test_readers_during_writes_and_retention(target, store: Store) -> None:
    """Two readers page through the stream while the sequencer writes and a trimmer deletes.

    Every page must be strictly increasing, each reader never sees a seq go backwards, and every
    event it sees has exactly the frame that was published for that seq."""
    published = Collector()
    total = 600
    stop = asyncio.Event()
    reader_store = await target.open()
    problems: list[str] = []
    seen_counts: list[int] = []

    async def reader() -> None:
        cursor = 0
        seen = 0
        while not stop.is_set() or cursor < total:
            oldest = await reader_store.oldest_seq()
            if oldest is not None and cursor < oldest - 1:
                cursor = oldest - 1  # fell out of the window: skip ahead, like OutdatedCursor
            page = await reader_store.read_after(cursor, 50)
            if not page:
                if stop.is_set() and cursor >= await reader_store.latest_seq():
                    break
                await asyncio.sleep(0.005)
                continue
            seqs = [e.seq for e in page]
            if seqs != sorted(set(seqs)) or seqs[0] <= cursor:
                problems.append(f"bad page after {cursor}: {seqs[:5]}")
            cursor = seqs[-1]
            seen += len(page)
        seen_counts.append(seen)

    async def trimmer() -> None:
        while not stop.is_set():
            await store.trim(max_bytes=150 * 2500, batch=20)
            await asyncio.sleep(0.01)

    try:
        async with Sequencer(store, published, max_batch=40) as seq:
            tasks = [
                asyncio.create_task(reader()),
                asyncio.create_task(reader()),
                asyncio.create_task(trimmer()),
            ]
            for start in range(1, total + 1, 50):
                await asyncio.gather(*(seq.submit(commit_event(n)) for n in range(start, start + 50)))
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        frames = {e.seq: e.frame for e in published.events}
        for event in await reader_store.read_after(0, total):
            assert frames[event.seq] == event.frame
        assert not problems, problems
        assert all(count > 0 for count in seen_counts)
        assert await store.latest_seq() == total
        oldest = await store.oldest_seq()
        assert oldest is not None and oldest > 1  # the trimmer really deleted
        remaining = await store.read_after(0, total)
        assert [e.seq for e in remaining] == list(range(oldest, total + 1))  # no hole in the window
    finally:
        await reader_store.close()


async def test_follow_replays_then_tails(store: Store) -> None:
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 6):
            await seq.submit(commit_event(n))
        got: list[int] = []

        async def consume() -> None:
            async for event in store.follow(2, page=2, poll_interval=0.01):
                got.append(event.seq)
                if len(got) == 6:
                    return

        task = asyncio.create_task(consume())
        await until(lambda: len(got) == 3, "the stored events read")  # then follows what comes next
        for n in range(6, 9):
            await seq.submit(commit_event(n))
        await asyncio.wait_for(task, 10)
    assert got == [3, 4, 5, 6, 7, 8]
    assert await store.count_events() == 8


async def test_follow_reads_pages_of_the_size_asked_and_waits_only_after_a_short_one(store: Store) -> None:
    """Each read asks for ``page`` events (1000 by default); a full page is followed at once by the
    next read, only a short one by the poll interval (here an hour: reaching event 5 proves no
    wait came after the full page 3–4)."""
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 6):
            await seq.submit(commit_event(n))
    reads: list[tuple[int, int]] = []
    read_after = store.read_after

    async def logged_read(cursor: int, limit: int = 1000) -> list[SequencedEvent]:
        reads.append((cursor, limit))
        return await read_after(cursor, limit)

    store.read_after = logged_read  # type: ignore[method-assign]

    async def take(n: int, tail: AsyncIterator[SequencedEvent]) -> list[int]:
        got = []
        async for event in tail:
            got.append(event.seq)
            if len(got) == n:
                break
        return got

    assert await asyncio.wait_for(take(3, store.follow(2, page=2, poll_interval=3600)), 10) == [3, 4, 5]
    assert reads == [(2, 2), (4, 2)]
    reads.clear()
    assert await asyncio.wait_for(take(5, store.follow(0, poll_interval=3600)), 10) == [1, 2, 3, 4, 5]
    assert reads == [(0, 1000)]
