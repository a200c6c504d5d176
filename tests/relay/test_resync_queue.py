"""``relay.resync_queue.ResyncQueue`` on its own: entries live until a resync succeeds, a kick
brings a waiting retry forward (not before its floor), an account marked again while its resync
runs is queued once more, ages fall in the gauge's buckets, and the held-bytes ledger."""

from __future__ import annotations

import asyncio

from relay.resync_queue import ResyncQueue


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _next(queue: ResyncQueue) -> str:
    return await asyncio.wait_for(queue.get(), 5.0)


async def test_a_failed_attempt_waits_and_a_kick_brings_it_forward_not_before_its_floor() -> None:
    clock = Clock()
    queue = ResyncQueue(kick_floor=0.05, clock=clock)
    await queue.enqueue("did:plc:a")
    await queue.enqueue("did:plc:a")  # idempotent
    assert queue.pending == 1 and await _next(queue) == "did:plc:a"
    queue.failed("did:plc:a", "fetch_failed", "getRepo answered HTTP 502", delay=3600.0)
    entry = queue.entry("did:plc:a")
    assert entry is not None and entry.state == "waiting" and entry.attempts == 1
    assert entry.next_retry == clock.now + 3600.0 and entry.last_failure == "fetch_failed"
    assert queue.kick("did:plc:a") and queue.kicks == 1
    assert entry.state == "waiting" and entry.next_retry == clock.now + 0.05  # the floor after the attempt
    assert not queue.kick("did:plc:a")  # already as early as it may be
    assert await _next(queue) == "did:plc:a"  # the timer of the kick, not the hour
    state: str = entry.state  # (mypy narrowed it to "waiting" above)
    assert state == "running" and not queue.kick("did:plc:a")
    queue.succeeded("did:plc:a")
    assert queue.pending == 0 and queue.entries() == []


async def test_a_kick_for_an_account_not_queued_queues_it() -> None:
    queue = ResyncQueue()
    assert queue.kick("did:plc:b")
    assert queue.pending == 1 and await _next(queue) == "did:plc:b"


async def test_marked_again_while_running_is_queued_once_more() -> None:
    clock = Clock()
    queue = ResyncQueue(clock=clock)
    await queue.enqueue("did:plc:c")
    assert await _next(queue) == "did:plc:c"
    clock.now += 10
    await queue.enqueue("did:plc:c")  # a buffered frame broke the chain again during the install
    queue.succeeded("did:plc:c")
    entry = queue.entry("did:plc:c")
    assert entry is not None and entry.state == "queued" and entry.since == clock.now
    assert await _next(queue) == "did:plc:c"


async def test_ages_fall_in_the_gauge_buckets_longest_first_in_the_list() -> None:
    clock = Clock()
    queue = ResyncQueue(clock=clock)
    for did, age in (("did:plc:new", 1), ("did:plc:min", 61), ("did:plc:hour", 3599), ("did:plc:day", 86_399),
                     ("did:plc:old", 86_400 * 3)):
        await queue.enqueue(did, since=clock.now - age)
    assert queue.by_age() == {"under_1m": 1, "under_10m": 1, "under_1h": 1, "under_1d": 1, "older": 1}
    assert [e.did for e in queue.entries()] == ["did:plc:old", "did:plc:day", "did:plc:hour", "did:plc:min",
                                                "did:plc:new"]
    queue.close()


def test_the_held_bytes_ledger_keeps_both_bounds() -> None:
    queue = ResyncQueue(held_per_account=100, held_total=150)
    assert queue.fits("a", 100) and not queue.fits("a", 101)
    queue.add_held("a", 90)
    assert not queue.fits("a", 11) and queue.fits("b", 60) and not queue.fits("b", 61)
    queue.add_held("b", 60)
    assert queue.held_bytes == 150 and not queue.fits("c", 1)
    queue.release_held("a", 40)
    assert queue.held_for("a") == 50 and queue.held_bytes == 110
    queue.release_held("a")
    assert queue.held_for("a") == 0 and queue.held_bytes == 60


async def test_discard_takes_out_a_waiting_entry_but_not_a_running_one() -> None:
    queue = ResyncQueue()
    await queue.enqueue("did:plc:d")
    assert await _next(queue) == "did:plc:d"
    queue.discard("did:plc:d")  # running: its attempt settles it
    assert queue.pending == 1
    queue.failed("did:plc:d", "fetch_failed", "", delay=3600.0)
    queue.discard("did:plc:d")
    assert queue.pending == 0 and queue.entry("did:plc:d") is None
