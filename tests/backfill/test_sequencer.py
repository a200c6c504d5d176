"""Sequencer behaviour on both backends: seq assignment, durability before publish, re-delivery,
restart, TRUNCATE, the single-writer lock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Any

import pytest

from backfill.errors import (
    BatchAbortedError,
    FencedOffError,
    SequencerClosedError,
    SequencerConflictError,
    SequencerLockedError,
)
from backfill.sequencer import Sequencer
from backfill.store import Store
from firehose.frames import encode_frame
from firehose.state import AccountState, Fence, PendingEvent, SequencedEvent
from mst.errors import ReasonError
from tests.backfill.conftest import StoreTarget, decode_frame
from tests.backfill.helpers import Collector, Faults, commit_event, rev_for, with_faults
from tests.waiting import until


async def test_sequences_frames_accounts_and_cursor(store: Store) -> None:
    published = Collector()
    async with Sequencer(store, published) as seq:
        results = await asyncio.gather(*(seq.submit(commit_event(n)) for n in range(1, 41)))
    assert [r.seq for r in results if r] == list(range(1, 41))
    replay = await store.read_after(0, 100)
    assert [e.seq for e in replay] == list(range(1, 41))
    for event, result in zip(replay, results, strict=True):
        assert result is not None
        assert event.frame == result.frame  # replay returns the bytes encoded at sequencing
        header, body = decode_frame(event.frame)
        assert header == {"op": 1, "t": "#commit"}
        assert body["seq"] == event.seq and body["upstream"] == event.seq
        assert event.frame == encode_frame("#commit", body)
        assert event.kind == "#commit" and event.did == body["repo"]
    assert [e.seq for e in published.events] == list(range(1, 41))
    assert await store.latest_seq() == 40
    assert await store.oldest_seq() == 1
    assert await store.host_cursor("pds.example") == 40
    account = await store.get_account("did:plc:acct0005")
    assert account is not None and account.rev == commit_event(39).rev  # 39 % 17 == 5, last one
    assert account.commit_cid == "bafycommit39" and account.updated_at > 0
    host = await store.get_host("pds.example")
    assert host is not None and host.account_count == 17 and host.last_seen
    assert await store.events_bytes() == sum(len(e.frame) for e in replay)


async def test_publish_happens_after_commit(store: Store) -> None:
    seen_durable: list[bool] = []

    async def publish(events: list[SequencedEvent]) -> None:
        stored = await store.read_after(events[0].seq - 1, len(events))
        seen_durable.append([e.frame for e in stored] == [e.frame for e in events])

    async with Sequencer(store, publish) as seq:
        await asyncio.gather(*(seq.submit(commit_event(n)) for n in range(1, 30)))
    assert seen_durable and all(seen_durable)


async def test_redelivery_of_same_or_older_rev_is_ignored(store: Store) -> None:
    published = Collector()
    async with Sequencer(store, published) as seq:
        first = await seq.submit(commit_event(5, did="did:plc:x"))
        again = await seq.submit(commit_event(5, did="did:plc:x"))
        older = await seq.submit(commit_event(4, did="did:plc:x"))
        newer = await seq.submit(commit_event(6, did="did:plc:x"))
        # Within one batch too:
        a, b = await asyncio.gather(
            seq.submit(commit_event(9, did="did:plc:y")), seq.submit(commit_event(9, did="did:plc:y"))
        )
        # Events without a rev (identity/account) are never deduplicated.
        ident = [
            await seq.submit(PendingEvent("#identity", "did:plc:x", {"did": "did:plc:x", "time": "t"}))
            for _ in range(2)
        ]
    assert first is not None and first.seq == 1
    assert again is None and older is None
    assert newer is not None and newer.seq == 2
    assert a is not None and b is None
    assert [e.seq for e in ident if e] == [4, 5]
    assert seq.stats.ignored == 3
    assert [e.seq for e in await store.read_after(0)] == [1, 2, 3, 4, 5]
    assert await store.host_cursor("pds.example") == 9


async def test_redeliveries_are_judged_against_the_stored_head_while_others_are_in_flight(store: Store) -> None:
    """A re-delivered event is recognised against the stored head of its account also while
    another account's batch is in flight (heads come from that batch for its accounts and from
    the store for the rest), and also when it carries a rev but no account state."""
    faults = Faults(None)
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()
    try:
        assert await seq.submit(commit_event(5, did="did:plc:b")) is not None
        faults.trigger = lambda batch: any(a.did == "did:plc:a" for a in batch.accounts)
        in_flight = asyncio.ensure_future(seq.submit(commit_event(6, did="did:plc:a")))
        await asyncio.wait_for(faults.reached.wait(), 10)  # A's batch held in its commit
        again = asyncio.ensure_future(seq.submit(commit_event(5, did="did:plc:b")))
        bare = replace(commit_event(4, did="did:plc:b"), account=None)  # a rev, no account state
        older = asyncio.ensure_future(seq.submit(bare))
        # both judged while A is still in flight: not newer than B's stored rev, so ignored
        await until(lambda: seq.stats.ignored == 2, "both re-deliveries recognised behind A")
        faults.go.set()
        assert (await in_flight) is not None
        assert await again is None and await older is None
        assert [e.did for e in await store.read_after(0, 10)] == ["did:plc:b", "did:plc:a"]
    finally:
        faults.go.set()
        await seq.close()


async def test_a_failed_head_lookup_holds_the_batch_or_fails_it(store: Store,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Reading the accounts' stored heads before numbering: while the store is unreachable the batch
    is held and the read retried; any other error fails the batch (its fences revoked) and the
    sequencer goes on."""
    caplog.set_level("WARNING", logger="backfill.sequencer")
    real = store.account_heads
    errors: list[BaseException] = [OSError("unreachable"), OSError("unreachable")]

    async def account_heads(dids: Any) -> Any:
        if errors:
            raise errors.pop(0)
        return await real(dids)

    store.account_heads = account_heads  # type: ignore[method-assign]
    async with Sequencer(store, Collector(), retry_base=0.001, retry_max=0.002) as seq:
        event = await seq.submit(commit_event(1))
        assert event is not None and event.seq == 1
        assert seq.stats.retries == 2 and seq.stats.failed_batches == 0 and seq.unavailable is None
        assert [getattr(r, "error", None) for r in caplog.records
                if r.getMessage().startswith("store unavailable")] == ["OSError: unreachable"]
        errors.append(RuntimeError("bad query"))
        run = Fence()
        with pytest.raises(RuntimeError, match="bad query"):
            await seq.submit(replace(commit_event(2), fence=run))
        assert not run.valid and seq.stats.failed_batches == 1
        later = await seq.submit(commit_event(3))
        assert later is not None and later.seq == 2


async def test_in_flight_heads_count_accounts_per_host_and_catch_re_deliveries(store: Store) -> None:
    """Accounts counted per host as the sequencer stores them (a new account +1, a move −1/+1, a
    later commit on the same host nothing), and a re-delivery judged against the head of a batch
    still in flight — with account state or with a rev alone."""
    faults = Faults(None)
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()
    try:
        for n, did, host in ((1, "did:plc:a", "h1"), (2, "did:plc:b", "h1"), (3, "did:plc:a", "h1"),
                             (4, "did:plc:b", "h2")):
            assert await seq.submit(commit_event(n, did=did, host=host)) is not None
        counts = {h: (await store.get_host(h)).account_count for h in ("h1", "h2")}  # type: ignore[union-attr]
        assert counts == {"h1": 1, "h2": 1}
        faults.trigger = lambda batch: bool(batch.events)
        held = asyncio.ensure_future(seq.submit(commit_event(5, did="did:plc:a", host="h1")))
        await asyncio.wait_for(faults.reached.wait(), 10)
        again = asyncio.ensure_future(seq.submit(commit_event(5, did="did:plc:a", host="h1")))
        await until(lambda: seq.stats.ignored == 1, "the re-delivery recognised against the batch in flight")
        faults.go.set()
        assert (await held) is not None and await again is None
        faults.trigger, faults.reached, faults.go = (lambda batch: bool(batch.events)), asyncio.Event(), asyncio.Event()
        bare = replace(commit_event(6, did="did:plc:a", host="h1"), account=None)
        held = asyncio.ensure_future(seq.submit(bare))
        await asyncio.wait_for(faults.reached.wait(), 10)
        again = asyncio.ensure_future(seq.submit(replace(bare)))
        await until(lambda: seq.stats.ignored == 2, "the bare re-delivery recognised against the batch in flight")
        faults.go.set()
        assert (await held) is not None and await again is None
        assert [e.seq for e in await store.read_after(0, 10)] == [1, 2, 3, 4, 5, 6]
        # one batch mixing an account in flight and a re-delivery for an account only in the store
        faults.trigger, faults.reached, faults.go = (lambda batch: bool(batch.events)), asyncio.Event(), asyncio.Event()
        held = asyncio.ensure_future(seq.submit(commit_event(7, did="did:plc:a", host="h1")))
        await asyncio.wait_for(faults.reached.wait(), 10)
        seq.max_batch = 2
        mixed = [asyncio.ensure_future(seq.submit(commit_event(8, did="did:plc:a", host="h1"))),
                 asyncio.ensure_future(seq.submit(commit_event(4, did="did:plc:b", host="h2")))]  # stored rev 4
        await until(lambda: seq.stats.ignored == 3, "the stored account's re-delivery recognised")
        faults.go.set()
        assert (await held) is not None and (await mixed[0]) is not None and await mixed[1] is None
    finally:
        faults.go.set()
        await seq.close()


async def test_in_flight_heads_keep_the_host_for_the_batches_behind(store: Store) -> None:
    """A batch numbered while the one before is still being committed counts accounts per host
    as if that one were stored: after an event with a rev alone (its account's host is the stored
    one) and after a new account's first commit (its host is the event's). Each later batch
    carries a re-delivery of a stored account, whose being ignored shows it was numbered."""
    faults = Faults(None)
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()

    async def count(host: str) -> int:
        state = await store.get_host(host)
        assert state is not None
        return state.account_count

    async def behind(first: PendingEvent, then: PendingEvent) -> None:
        """``then`` (with a re-delivery of b) numbered while ``first`` is held in its commit."""
        faults.trigger, faults.reached, faults.go = (lambda batch: bool(batch.events)), asyncio.Event(), asyncio.Event()
        seq.max_batch = 1
        held = asyncio.ensure_future(seq.submit(first))
        await asyncio.wait_for(faults.reached.wait(), 10)
        seq.max_batch = 2
        ignored = seq.stats.ignored
        later = [asyncio.ensure_future(seq.submit(then)),
                 asyncio.ensure_future(seq.submit(commit_event(2, did="did:plc:b", host="h1")))]
        await until(lambda: seq.stats.ignored > ignored, "the batch behind numbered")
        faults.go.set()
        assert (await held) is not None and (await later[0]) is not None and await later[1] is None

    try:
        for n, did in ((1, "did:plc:a"), (2, "did:plc:b")):
            assert await seq.submit(commit_event(n, did=did, host="h1")) is not None
        assert await count("h1") == 2
        # a's rev alone in flight, then a commit of a with its state on the same host: no move
        await behind(replace(commit_event(3, did="did:plc:a", host="h1"), account=None),
                     commit_event(4, did="did:plc:a", host="h1"))
        assert await count("h1") == 2
        # c's first commit in flight, then c's next one: one new account, not two
        await behind(commit_event(5, did="did:plc:c", host="h1"), commit_event(6, did="did:plc:c", host="h1"))
        assert await count("h1") == 3
        # an event with a rev alone for an account the relay has no head for is numbered
        assert await seq.submit(replace(commit_event(7, did="did:plc:d", host="h1"), account=None)) is not None
        assert [e.seq for e in await store.read_after(0, 10)] == [1, 2, 3, 4, 5, 6, 7]
    finally:
        faults.go.set()
        await seq.close()


async def test_an_account_write_in_flight_gives_its_rev_to_the_batches_behind(store: Store) -> None:
    """An account written with no event (a newer rev, e.g. after a resync) is the head a later
    batch judges re-deliveries by while the write is still being committed, as it is once stored."""
    faults = Faults(None)
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()
    try:
        assert await seq.submit(commit_event(1, did="did:plc:a", host="h1")) is not None
        newer = commit_event(9, did="did:plc:a", host="h1").account
        assert newer is not None
        faults.trigger = lambda batch: bool(batch.accounts) and not batch.events
        written = asyncio.ensure_future(seq.write_account(newer))
        await asyncio.wait_for(faults.reached.wait(), 10)
        seq.max_batch = 2  # with a re-delivery of the stored commit: ignored either way
        stale = [asyncio.ensure_future(seq.submit(commit_event(n, did="did:plc:a", host="h1"))) for n in (8, 1)]
        await until(lambda: seq.stats.ignored > 0, "the batch behind the write numbered")
        assert seq.stats.ignored == 2  # the stale commit judged against the write in flight
        faults.go.set()
        await asyncio.wait_for(written, 10)
        assert [await s for s in stale] == [None, None]
        assert await seq.submit(commit_event(8, did="did:plc:a", host="h1")) is None  # and once stored
        assert [e.seq for e in await store.read_after(0, 10)] == [1]
    finally:
        faults.go.set()
        await seq.close()


async def test_a_batch_whose_head_lookup_spans_a_refused_commit_is_numbered_afresh(store: Store) -> None:
    """A commit refused while the next batch reads its accounts' heads: that batch is looked up
    and numbered again once the sequencer has re-synced, and its submitter gets its event (not
    dropped, not left waiting)."""
    faults = Faults(RuntimeError("refused (injected)"))
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    real_heads = store.account_heads
    entered, release = asyncio.Event(), asyncio.Event()

    async def account_heads(dids: Any) -> Any:
        if "did:plc:behind" in dids:
            entered.set()
            await release.wait()
        return await real_heads(dids)

    store.account_heads = account_heads  # type: ignore[method-assign]
    await seq.start()
    try:
        faults.trigger = lambda batch: bool(batch.events)
        refused = asyncio.ensure_future(seq.submit(commit_event(1, did="did:plc:first")))
        await asyncio.wait_for(faults.reached.wait(), 10)
        behind = asyncio.ensure_future(seq.submit(commit_event(2, did="did:plc:behind")))
        await asyncio.wait_for(entered.wait(), 10)  # its lookup is under way...
        faults.go.set()
        with pytest.raises(RuntimeError, match="refused"):  # ...when the commit before it is refused
            await asyncio.wait_for(refused, 10)
        release.set()
        event = await asyncio.wait_for(behind, 10)
        assert event is not None and event.seq == 1 and event.did == "did:plc:behind"
        assert [(e.seq, e.did) for e in await store.read_after(0, 10)] == [(1, "did:plc:behind")]
    finally:
        faults.go.set()
        release.set()
        await seq.close()


async def test_collection_counts_and_the_hosts_last_seen_are_written_with_the_batch(store: Store) -> None:
    """What a batch writes besides its events: each account's record counts per collection (an
    event's complete counts, then its commits' creates and deletes) and, for each host, the time of
    the batch's first event (the sequencer's clock, kept strictly increasing)."""
    async with Sequencer(store, Collector(), clock=lambda: 1234.5, max_batch=1, max_delay=0) as seq:
        counted = replace(commit_event(1, did="did:plc:a", host="h1"), collections={"app.bsky.feed.like": 3})
        assert await seq.submit(counted) is not None
        posts = (("app.bsky.feed.post", "create"), ("app.bsky.feed.post", "create"), ("app.bsky.feed.like", "delete"))
        last = await seq.submit(replace(commit_event(2, did="did:plc:a", host="h1"), op_changes=posts))
    assert await store.collection_counts("did:plc:a") == {"app.bsky.feed.like": 2, "app.bsky.feed.post": 2}
    host = await store.get_host("h1")
    assert last is not None and last.time == 1234.5 + 1e-6  # the clock stands still: 1 µs after the first
    assert host is not None and host.last_seen == last.time and host.account_count == 1


async def test_the_defaults_the_relay_runs_with(store: Store) -> None:
    """The relay builds its sequencer with these (``relay.wiring``): batches of up to 1000 events
    gathered for at most 2 ms, 20,000 submits queued before submitters wait, store retries paced
    from 50 ms up to 2 s, a wait for the lease logged once a minute; frames from the standard encoder.
    Before it starts it is ``stopped``, with no failure, no outage and no lease holder to name;
    it can be closed without ever starting."""
    seq = Sequencer(store, Collector())
    assert (seq.state, seq.failure, seq.unavailable, seq.lease_holder) == ("stopped", None, None, None)
    assert (seq.max_batch, seq.max_delay, seq.max_pending) == (1000, 0.002, 20000)
    assert (seq.retry_base, seq.retry_max, seq.wait_log_interval) == (0.05, 2.0, 60.0)
    assert seq.frame_encoder("#identity", {"did": "did:plc:a", "seq": 1}) == encode_frame("#identity", {"did": "did:plc:a", "seq": 1})
    await seq.close()  # closing one never started holds nothing to release
    with pytest.raises(SequencerClosedError, match="^sequencer is closed$"):
        await seq.start()


async def test_event_times_strictly_increase_by_whole_microseconds(store: Store) -> None:
    """A clock that stands still (or goes back) still gives every event a later time: 1 µs after
    the one before."""
    async with Sequencer(store, Collector(), clock=lambda: 1000.0, max_batch=2) as seq:
        events = [await seq.submit(commit_event(n)) for n in range(1, 5)]
    times = [e.time for e in events if e]
    assert times[0] == 1000.0 and all(abs(b - a - 1e-6) < 1e-9 for a, b in zip(times, times[1:], strict=False))


async def test_commit_errors_after_an_outage_and_from_another_writer(store: Store) -> None:
    """While reconnecting after an outage: a lease still unreachable means wait and commit again
    (the batch is written once, after the outage); a lease that fails otherwise fails the batch
    and the sequencer goes on. A commit refused because another writer holds the store stops it
    for good, failing that batch with the writer's error."""
    faults = Faults(None)
    seq = Sequencer(with_faults(store, faults), Collector(), retry_base=0.001, retry_max=0.002, max_batch=1)
    await seq.start()
    try:
        before = seq.last_commit_at
        faults.down, faults.lease_failures = True, 2  # the new lease cannot be read at first either
        held = asyncio.ensure_future(seq.submit(commit_event(1)))
        await until(lambda: faults.refused >= 2 and faults.lease_failures == 0, "the reconnection tried")
        faults.down = False
        event = await asyncio.wait_for(held, 10)
        assert event is not None and event.seq == 1
        assert [e.seq for e in await store.read_after(0, 10)] == [1] and seq.last_commit_at > before
        faults.down, faults.lease_error = True, RuntimeError("lease broken")
        failing = asyncio.ensure_future(seq.submit(commit_event(2)))
        await until(lambda: faults.lease_error is None, "the lease read while reconnecting")
        faults.down = False
        with pytest.raises(RuntimeError, match="lease broken"):
            await failing
        later = await seq.submit(commit_event(3))
        assert later is not None and later.seq == 2 and seq.state == "running"
        assert (seq.stats.batches, seq.stats.events, seq.stats.failed_batches) == (2, 2, 1)
        assert seq._overlay == {}  # every committed head handed back to the store
        faults.error, faults.trigger = SequencerConflictError("the mark moved"), (lambda batch: True)
        faults.go.set()
        with pytest.raises(SequencerConflictError, match="the mark moved"):
            await seq.submit(commit_event(4))
        assert seq.state == "failed" and str(seq.failure) == "the mark moved"
    finally:
        faults.down = False
        faults.go.set()
        with contextlib.suppress(Exception):
            await seq.close()


async def test_encode_errors_are_counted_across_batches(store: Store) -> None:
    def encoder(kind: str, body: dict) -> bytes:
        if body.get("poison"):
            raise ValueError("cannot encode")
        return encode_frame(kind, body)

    async with Sequencer(store, Collector(), encoder, max_batch=1) as seq:
        for _ in range(2):
            with pytest.raises(ValueError):
                await seq.submit(PendingEvent("#identity", "did:plc:p", {"poison": True}))
    assert seq.stats.encode_errors == 2


async def test_seq_monotonic_across_restart(target: StoreTarget, store: Store) -> None:
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 11):
            await seq.submit(commit_event(n))
    await store.close()
    reopened = await target.open()
    try:
        async with Sequencer(reopened, Collector()) as seq:
            assert seq.high_water == 10
            later = [await seq.submit(commit_event(n)) for n in range(11, 16)]
        assert [e.seq for e in later if e] == [11, 12, 13, 14, 15]
        assert [e.seq for e in await reopened.read_after(0)] == list(range(1, 16))
    finally:
        await reopened.close()


async def test_high_water_survives_truncate(target: StoreTarget, store: Store) -> None:
    async with Sequencer(store, Collector()) as seq:
        for n in range(1, 8):
            await seq.submit(commit_event(n))
    await target.sql("TRUNCATE events" if target.backend == "postgres" else "DELETE FROM events")
    assert await store.oldest_seq() is None
    assert await store.latest_seq() == 7
    async with Sequencer(store, Collector()) as seq:
        event = await seq.submit(commit_event(100))
    assert event is not None and event.seq == 8
    assert [e.seq for e in await store.read_after(0)] == [8]


async def test_second_sequencer_is_refused(target: StoreTarget, store: Store) -> None:
    other_store = await target.open()
    try:
        async with Sequencer(store, Collector()) as first:
            second = Sequencer(other_store, Collector())
            with pytest.raises(SequencerLockedError) as info:
                await second.start()
            assert info.value.reason == "sequencer_locked"
            assert "another sequencer" in str(info.value)
            with pytest.raises(SequencerLockedError):
                await second.submit(commit_event(1))
            await first.submit(commit_event(1))
        # A waiting sequencer takes over once the first one is gone.
        waiting = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=10)
        async with waiting:
            event = await waiting.submit(commit_event(2))
        assert event is not None and event.seq == 2
    finally:
        await other_store.close()


async def test_waiting_sequencer_gets_lock_after_release(target: StoreTarget, store: Store) -> None:
    other_store = await target.open()
    try:
        first = Sequencer(store, Collector())
        await first.start()
        waiter = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=10)
        start = asyncio.create_task(waiter.start())
        await until(lambda: waiter.state == "waiting", "the second sequencer waiting for the lease")
        assert not start.done() and waiter.lease_holder is not None
        await first.submit(commit_event(1))
        await first.close()
        await asyncio.wait_for(start, 10)
        event = await waiter.submit(commit_event(2))
        assert event is not None and event.seq == 2
        await waiter.close()
        timed_out = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=0.3)
        async with Sequencer(store, Collector()):
            with pytest.raises(SequencerLockedError):
                await timed_out.start()
    finally:
        await other_store.close()


async def test_a_lease_holder_that_cannot_be_named_is_unknown(target: StoreTarget, store: Store) -> None:
    other_store = await target.open()

    async def unnamed() -> str | None:
        raise RuntimeError("cannot read the lock table")

    other_store.writer_holder = unnamed  # type: ignore[method-assign]
    first = Sequencer(store, Collector())
    await first.start()
    waiter = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=10)
    start = asyncio.create_task(waiter.start())
    try:
        await until(lambda: waiter.state == "waiting", "the second sequencer waiting for the lease")
        assert waiter.lease_holder == "unknown (RuntimeError)"
        await first.close()
        await asyncio.wait_for(start, 10)
        assert waiter.lease_holder is None and waiter.state == "running"
    finally:
        await first.close()
        await waiter.close()
        await other_store.close()


async def test_encoder_failure_fails_only_that_event(store: Store) -> None:
    def encoder(kind: str, body: dict) -> bytes:
        if body.get("poison"):
            raise ValueError("cannot encode")
        return encode_frame(kind, body)

    async with Sequencer(store, Collector(), encoder) as seq:
        good1 = seq.submit(commit_event(1))
        bad = seq.submit(PendingEvent("#identity", "did:plc:p", {"poison": True}))
        good2 = seq.submit(commit_event(2))
        results = await asyncio.gather(good1, bad, good2, return_exceptions=True)
    assert isinstance(results[1], ValueError)
    assert [r.seq for r in (results[0], results[2])] == [1, 2]  # no hole in seq
    assert seq.stats.encode_errors == 1


async def test_cursor_only_advance_and_publish_errors(store: Store) -> None:
    async def failing_publish(events: list[SequencedEvent]) -> None:
        raise RuntimeError("bus down")

    async with Sequencer(store, failing_publish) as seq:
        event = await seq.submit(commit_event(3, host="h.example"))
        await seq.advance_cursor("h.example", 10)
        await seq.advance_cursor("new.example", 4)
        second = await seq.submit(commit_event(11, host="h.example"))
    assert event is not None and second is not None  # durable even though the bus failed
    assert seq.stats.publish_errors == 2
    assert await store.host_cursor("h.example") == 11
    assert await store.host_cursor("new.example") == 4
    assert len(await store.read_after(0)) == 2


async def test_account_rows_are_written_whole_with_their_event_or_alone(store: Store) -> None:
    """The account lanes are the only writers of account rows, through the sequencer: a takedown's
    local status is stored with its ``#account`` (one transaction), the state a later event
    carries is stored whole, and ``write_account`` stores a state with no event."""
    async with Sequencer(store, Collector()) as seq:
        taken = AccountState("did:plc:t", host="pds.example", local_status="takendown")
        stored = await seq.submit(PendingEvent("#account", "did:plc:t", {"did": "did:plc:t", "active": False,
                                                                         "status": "takendown"}, account=taken))
        assert stored is not None
        account = await store.get_account("did:plc:t")
        assert account is not None and account.local_status == "takendown"
        event = commit_event(1, did="did:plc:t")
        assert event.account is not None
        event.account.local_status = "takendown"  # the lane judges on the state it owns
        await seq.submit(event)
        account = await store.get_account("did:plc:t")
        assert account is not None and account.local_status == "takendown" and account.rev == commit_event(1).rev
        await seq.write_account(AccountState("did:plc:u", host="pds.example", sync_state="throttled"))
        held = await store.get_account("did:plc:u")
        assert held is not None and held.sync_state == "throttled"
        assert (await store.get_host("pds.example")).account_count == 2  # type: ignore[union-attr]
    assert [e.did for e in await store.read_after(0)] == ["did:plc:t", "did:plc:t"]  # no event for the write


async def test_a_state_without_a_rev_keeps_the_stored_head(target: StoreTarget, store: Store) -> None:
    """The lanes never write an account state without a rev over one with a rev; were one written
    (alone or with its event), the stored head (rev, commit and data CIDs) stays, the rest of the
    row is the new state's, and a re-delivery is still recognised after a restart."""
    did = "did:plc:head"
    async with Sequencer(store, Collector()) as seq:
        assert await seq.submit(commit_event(1, did=did)) is not None
        await seq.write_account(AccountState(did, host="pds.example", sync_state="desynchronized"))
        got = await store.get_account(did)
        assert got is not None
        assert (got.rev, got.commit_cid, got.data_cid, got.sync_state) == (
            rev_for(1), "bafycommit1", "bafydata1", "desynchronized")
        taken = AccountState(did, host="pds.example", local_status="takendown")
        assert await seq.submit(PendingEvent("#account", did, {"did": did, "active": False, "status": "takendown"},
                                             account=taken)) is not None
        got = await store.get_account(did)
        assert got is not None
        assert (got.rev, got.commit_cid, got.data_cid, got.local_status, got.sync_state) == (
            rev_for(1), "bafycommit1", "bafydata1", "takendown", "synced")
    await store.close()
    reopened = await target.open()
    try:
        async with Sequencer(reopened, Collector()) as seq:  # heads read from the store alone
            assert await seq.submit(commit_event(1, did=did)) is None
            assert await seq.submit(commit_event(2, did=did)) is not None
        got = await reopened.get_account(did)
        assert got is not None and (got.rev, got.commit_cid) == (rev_for(2), "bafycommit2")
    finally:
        await reopened.close()


async def test_closed_sequencer_refuses(store: Store) -> None:
    seq = Sequencer(store, Collector())
    await seq.submit(commit_event(1))
    await seq.close()
    with pytest.raises(SequencerClosedError, match="^sequencer is closed$"):
        await seq.submit(commit_event(2))
    with pytest.raises(SequencerClosedError, match="^sequencer is closed$"):
        await seq.start()


async def test_seq_stays_below_2_pow_53(target: StoreTarget, store: Store) -> None:
    await target.sql(f"UPDATE relay_meta SET value = {2**53 - 3} WHERE key = 'seq_high_water'")
    async with Sequencer(store, Collector()) as seq:
        results = await asyncio.gather(
            *(seq.submit(commit_event(n)) for n in range(1, 5)), return_exceptions=True
        )
    ok = [r.seq for r in results if isinstance(r, SequencedEvent)]
    assert ok == [2**53 - 2, 2**53 - 1]
    assert [getattr(r, "reason", None) for r in results[2:]] == ["seq_exhausted", "seq_exhausted"]
    assert await store.latest_seq() == 2**53 - 1


async def test_batches_are_bounded(store: Store) -> None:
    published = Collector()
    seq = Sequencer(store, published, max_batch=16, max_delay=0.01)
    async with seq:
        futures = [await seq.enqueue(commit_event(n)) for n in range(1, 101)]
        results = await asyncio.gather(*futures)
    assert [r.seq for r in results if r] == list(range(1, 101))
    assert max(len(b) for b in published.batches) <= 16
    assert len(published.batches) < 100  # actually batched


BOOM_SQL = {
    "postgres": [
        "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.did = 'did:plc:boom' THEN RAISE EXCEPTION 'boom'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER boom BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION boom()",
    ],
    "sqlite": [
        "CREATE TRIGGER boom BEFORE INSERT ON events WHEN new.did = 'did:plc:boom' "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END",
    ],
}


async def test_failed_commit_writes_nothing_and_numbering_resumes(target: StoreTarget, store: Store) -> None:
    for statement in BOOM_SQL[target.backend]:
        await target.sql(statement)
    published = Collector()
    async with Sequencer(store, published, max_batch=10, max_delay=0.01) as seq:
        first = await asyncio.gather(*(seq.submit(commit_event(n)) for n in range(1, 11)))
        # A batch the database refuses: every event in it fails, and so may a batch numbered
        # behind it; none of them is stored or published.
        doomed = [seq.submit(commit_event(n)) for n in range(11, 16)]
        doomed.append(seq.submit(commit_event(16, did="did:plc:boom")))
        doomed += [seq.submit(commit_event(n)) for n in range(17, 30)]
        outcome = await asyncio.gather(*doomed, return_exceptions=True)
        failed = [r for r in outcome if isinstance(r, BaseException)]
        assert len(failed) >= 6
        assert all(
            not isinstance(r, BaseException) or r.__class__.__name__ != "SequencerClosedError"
            for r in outcome
        )
        # The writer carries on, numbering from the stored mark: no gap, no reuse.
        later = [await seq.submit(commit_event(n)) for n in range(40, 45)]
    assert [e.seq for e in first] == list(range(1, 11))
    stored = await store.read_after(0, 100)
    seqs = [e.seq for e in stored]
    assert seqs == list(range(1, len(stored) + 1))
    assert [e.seq for e in later if e] == seqs[-5:]
    assert [e.seq for e in published.events] == seqs
    assert "did:plc:boom" not in {e.did for e in stored}
    assert seq.stats.failed_batches >= 1


async def test_a_batch_numbered_before_a_refused_commit_is_voided(store: Store,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Batch k+1 is numbered while batch k commits, on top of k's in-flight account state. When
    the store refuses k, k+1 is void even where its seqs still fit the stored mark (k wrote no
    event: an account row alone): its submitter gets ``BatchAbortedError``, nothing of it is
    stored, and its fence — shared with k's, one upstream run — is revoked with k's reason;
    numbering resumes. Twice, with two kinds of error: every refusal voids what was numbered."""
    faults = Faults(RuntimeError("unused"))
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()
    try:
        did = "did:plc:epoch"
        for n, error, reason in ((1, RuntimeError("write refused"), "RuntimeError"),
                                 (4, ReasonError("write_refused", "no"), "write_refused")):
            faults.error, faults.reached, faults.go = error, asyncio.Event(), asyncio.Event()
            run = Fence()
            faults.trigger = lambda batch: not batch.events and bool(batch.accounts)
            account_write = asyncio.create_task(seq.write_account(
                AccountState(did=did, host="pds.example", rev=rev_for(n), commit_cid="c", data_cid="d"), run))
            await asyncio.wait_for(faults.reached.wait(), 10)  # batch k held in its commit
            mark = seq.high_water
            behind = await seq.enqueue(replace(commit_event(n + 1, did=did), fence=run))
            await until(lambda m=mark: seq._next_high_water == m + 1, "batch k+1 numbered behind k")
            faults.go.set()  # k is refused
            with pytest.raises(type(error)):
                await account_write
            with pytest.raises(BatchAbortedError):
                await behind
            assert not run.valid and run.reason == reason
            event = await seq.submit(commit_event(n + 2, did=did))  # a new run: numbered from the stored mark
            assert event is not None and event.seq == mark + 1
        assert [e.seq for e in await store.read_after(0, 10)] == [1, 2]  # the two new runs' events only
        stored = await store.get_account(did)
        assert stored is not None and stored.rev == rev_for(6)
        assert seq.stats.failed_batches == 4
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("sequencer batch")] == [
            "sequencer batch of 1 not written: write refused",
            "sequencer batch of 1 not written: an earlier batch failed; resubmit",
            "sequencer batch of 1 not written: write_refused: no",
            "sequencer batch of 1 not written: an earlier batch failed; resubmit"]
    finally:
        faults.go.set()
        await seq.close()


@pytest.mark.parametrize("case", ["unreachable", "unreachable_twice", "committed", "committed_unreachable",
                                  "lease_lost", "taken"])
async def test_recovery_after_a_refused_commit(target: StoreTarget, store: Store, case: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """After a refused commit the sequencer reloads the stored mark through its lease before it
    numbers anything else. ``unreachable``: the lease's connection is dead meanwhile — it is
    released and taken again (logged), numbering goes on; ``unreachable_twice``: the new lease
    cannot be read at first either — the sequencer waits for the store (logged) and goes on.
    ``committed``: the refused commit did reach the database — numbering goes on after it
    (``committed_unreachable``: once the store answers again). ``lease_lost``: the lease cannot be
    read for another reason — stop for good. ``taken``: another writer took the lease meanwhile —
    stop."""
    caplog.set_level("WARNING", logger="backfill.sequencer")
    faults = Faults(RuntimeError("write refused"))
    other = await target.open()
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1, max_delay=0)
    await seq.start()
    held: list[Any] = []
    try:
        assert (await seq.submit(commit_event(1))) is not None
        if case.startswith("committed"):
            faults.after_commit = RuntimeError("write refused")
        else:
            faults.trigger = lambda batch: bool(batch.events)
        if case in ("unreachable", "taken"):
            faults.lease_failures = 1
        if case in ("unreachable_twice", "committed_unreachable"):
            faults.lease_failures = 2
        if case == "lease_lost":
            faults.lease_error = RuntimeError("lease gone")
        if case == "taken":
            async def take() -> None:
                held.append(await other.acquire_writer(wait=False))
            faults.on_release = take
        faults.go.set()
        with pytest.raises(RuntimeError, match="write refused"):
            await seq.submit(commit_event(2))
        if not case.startswith(("lease_lost", "taken")):
            event = await seq.submit(commit_event(3))
            expected = 3 if case.startswith("committed") else 2
            assert event is not None and event.seq == expected and seq.state == "running"
            assert [e.seq for e in await store.read_after(0, 10)] == list(range(1, expected + 1))
            retaken = [r for r in caplog.records if r.getMessage() == "sequencer: writer lease re-taken"]
            assert [getattr(r, "high_water", None) for r in retaken] == ([1] if case == "unreachable" else [])
            waited = [getattr(r, "error", None) for r in caplog.records
                      if r.getMessage() == "store unavailable; holding batches and retrying"]
            assert waited == (["OSError: store unreachable while recovering (injected)"]
                              if case.endswith(("twice", "_unreachable")) else [])
        else:
            assert seq.state == "failed"
            if case == "lease_lost":
                assert isinstance(seq.failure, SequencerConflictError)
                assert str(seq.failure) == "writer lease lost and not recoverable: lease gone"
            else:
                assert isinstance(seq.failure, SequencerLockedError) and held
            with pytest.raises(SequencerClosedError, match="^sequencer stopped: "):
                await seq.submit(commit_event(3))
            await seq.close()  # a failed sequencer still closes cleanly (no lease left to release)
    finally:
        faults.go.set()
        with contextlib.suppress(Exception):
            await seq.close()
        for lease in held:
            await lease.release()
        await other.close()


def _outage_log(caplog: pytest.LogCaptureFixture) -> list[tuple[str, object]]:
    """The sequencer's outage lines: (message, its ``error`` or ``retries`` field)."""
    out: list[tuple[str, object]] = []
    for r in caplog.records:
        if r.name == "backfill.sequencer" and "available" in r.getMessage():
            out.append((r.getMessage(), getattr(r, "error", getattr(r, "retries", None))))
    return out


async def test_an_unavailable_store_holds_the_batch_until_it_answers(store: Store,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """While commits fail as unreachable (``Store.is_transient``) the batch is held and retried —
    nothing failed, ``retrying``, one log line when an outage begins and one when it ends, with
    the attempts of that outage — and written once the store answers; a commit made whose reply
    was lost is recognised by the stored mark and not written twice; a mark moved elsewhere
    (another writer) stops the sequencer for good."""
    caplog.set_level("INFO", logger="backfill.sequencer")
    faults = Faults(RuntimeError("unused"))
    published = Collector()
    seq = Sequencer(with_faults(store, faults), published, retry_base=0.001, retry_max=0.002)
    await seq.start()
    try:
        refused = 0
        for n, attempts in ((1, 3), (2, 2)):  # two outages, each counted on its own
            faults.down, faults.refused = True, 0
            held = asyncio.ensure_future(seq.submit(commit_event(n)))
            await until(lambda a=attempts: faults.refused >= a, "refused attempts")
            assert seq.state == "retrying" and isinstance(seq.unavailable, OSError) and not held.done()
            faults.down = False
            event = await asyncio.wait_for(held, 10)
            assert event is not None and event.seq == n
            assert seq.state == "running" and seq.unavailable is None and seq.stats.failed_batches == 0
            assert _outage_log(caplog)[-2:] == [
                ("store unavailable; holding batches and retrying", "OSError: store unreachable (injected)"),
                ("store available again; sequencing resumed", faults.refused)]
            refused += faults.refused
        assert seq.stats.retries == refused  # one per refused attempt
        faults.lose_reply = 1  # committed, but the connection drops before the reply
        third = await seq.submit(commit_event(3))
        assert third is not None and third.seq == 3
        assert [e.seq for e in await store.read_after(0, 10)] == [1, 2, 3]
        assert [e.seq for e in published.events] == [1, 2, 3] and seq.stats.failed_batches == 0
        # the stored mark is neither before nor after the batch: another writer; stop for good
        faults.high_water_shift, faults.lose_reply = 5, 1
        with pytest.raises(SequencerConflictError, match=r"^seq high-water mark is 9, expected 3 or 4$"):
            await seq.submit(commit_event(4))
        assert seq.state == "failed" and isinstance(seq.failure, SequencerConflictError)
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
            "sequencer stopped: seq high-water mark is 9, expected 3 or 4"]
        with pytest.raises(SequencerClosedError, match="^sequencer stopped: seq high-water mark is 9"):
            await seq.submit(commit_event(5))
        with pytest.raises(SequencerClosedError, match="not running: seq high-water mark is 9"):
            seq.enqueue_nowait(commit_event(5))  # failed, not closed
    finally:
        faults.down, faults.high_water_shift = False, 0
        with contextlib.suppress(Exception):
            await seq.close()


async def test_a_lease_that_cannot_be_taken_again_keeps_the_sequencer_retrying(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """The store goes away under a held batch and its lease is lost with it: while taking the lease
    again keeps failing, the sequencer stays ``retrying`` (one outage, backing off: one log line,
    a retry counted per failed attempt), and the batch is written once the lease is back."""
    caplog.set_level("INFO", logger="backfill.sequencer")
    faults = Faults(RuntimeError("unused"))
    seq = Sequencer(with_faults(store, faults), Collector(), retry_base=0.001, retry_max=0.002)
    await seq.start()
    try:
        faults.down, faults.lease_failures, faults.acquire_failures = True, 1, 1000
        held = asyncio.ensure_future(seq.submit(commit_event(1)))
        await until(lambda: faults.acquire_failures <= 996, "four failed attempts to take the lease again")
        assert seq.state == "retrying" and isinstance(seq.unavailable, OSError) and not held.done()
        assert seq.stats.retries >= 4  # the first refusal and every failed attempt after the lease was lost
        assert _outage_log(caplog) == [
            ("store unavailable; holding batches and retrying", "OSError: store unreachable (injected)")]
        faults.down, faults.acquire_failures = False, 0
        event = await asyncio.wait_for(held, 10)
        assert event is not None and event.seq == 1 and seq.state == "running" and seq.unavailable is None
        assert _outage_log(caplog)[-1] == ("store available again; sequencing resumed", seq.stats.retries)
        assert [e.seq for e in await store.read_after(0, 10)] == [1]
    finally:
        faults.down, faults.acquire_failures = False, 0
        with contextlib.suppress(Exception):
            await seq.close()


async def test_enqueue_nowait_hands_over_in_order_only_while_running(store: Store) -> None:
    gate = asyncio.Event()

    async def held_publish(events: list[SequencedEvent]) -> None:
        await gate.wait()

    seq = Sequencer(store, held_publish)
    with pytest.raises(SequencerClosedError, match="not running: stopped"):
        seq.enqueue_nowait(commit_event(1))  # not started
    await seq.start()
    futures = [seq.enqueue_nowait(commit_event(n)) for n in range(1, 4)]
    await until(lambda: all(f.done() for f in futures), "events 1-3 durable")  # their publish is held
    assert [f.result().seq for f in futures if f.result()] == [1, 2, 3]
    closing = asyncio.create_task(seq.close())
    await until(lambda: seq._closed, "close() begun")  # the writer has not stopped yet
    with pytest.raises(SequencerClosedError, match="not running"):
        seq.enqueue_nowait(commit_event(4))
    gate.set()
    await closing
    with pytest.raises(SequencerClosedError, match="not running"):
        seq.enqueue_nowait(commit_event(4))


async def test_a_cursor_advance_of_a_lost_run_is_refused(store: Store) -> None:
    """``advance_cursor`` and ``write_account`` with a revoked fence (an event of their run was
    lost) store nothing."""
    async with Sequencer(store, Collector()) as seq:
        await seq.advance_cursor("h.example", 5)
        lost = Fence()
        lost.revoke("an earlier event of this run failed")
        with pytest.raises(FencedOffError):
            await seq.advance_cursor("h.example", 9, lost)
        assert seq.stats.fenced == 1
        await seq.advance_cursor("h.example", 7, Fence())
        with pytest.raises(FencedOffError):  # nor an account row of a lost run
            await seq.write_account(AccountState(did="did:plc:lost", host="h.example", rev=rev_for(1)), lost)
        assert seq.stats.fenced == 2
    host = await store.get_host("h.example")
    assert host is not None and host.cursor == 7  # 9 never stored: only forward from 5
    assert await store.get_account("did:plc:lost") is None


async def test_lost_postgres_connection_is_recovered(pg_target: StoreTarget) -> None:
    """The writer's connection (which holds the advisory lock) is killed by the server: the batch
    in flight fails, the sequencer re-takes the lock and carries on from the stored mark."""
    import asyncpg

    target = pg_target
    store = await target.open()
    await store.migrate()
    async with Sequencer(store, Collector()) as seq:
        assert (await seq.submit(commit_event(1))) is not None
        pid = seq._lease._conn.get_server_pid()  # type: ignore[union-attr]
        admin = await asyncpg.connect(target.url)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        outcome = await asyncio.gather(seq.submit(commit_event(2)), return_exceptions=True)
        assert isinstance(outcome[0], (BaseException, SequencedEvent))
        later = await seq.submit(commit_event(3))
        assert later is not None
        # The lock moved to the new connection: a second sequencer is still refused.
        other = await target.open()
        try:
            with pytest.raises(SequencerLockedError):
                await Sequencer(other, Collector()).start()
        finally:
            await other.close()
    stored = [e.seq for e in await store.read_after(0)]
    assert stored == list(range(1, len(stored) + 1)) and stored[-1] == later.seq
    await store.close()


async def test_backpressure_keeps_order(store: Store) -> None:
    published = Collector()
    async with Sequencer(store, published, max_batch=4, max_pending=5) as seq:
        futures = await asyncio.wait_for(
            asyncio.gather(*(seq.enqueue(commit_event(n)) for n in range(1, 41))), 30
        )
        results = await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert [r.seq for r in results if r] == list(range(1, 41))
    upstream = [decode_frame(e.frame)[1]["upstream"] for e in published.events]
    assert upstream == list(range(1, 41))


async def test_enqueuer_blocked_on_a_full_queue_is_released_by_close(store: Store) -> None:
    gate = asyncio.Event()

    async def slow_publish(events: list[SequencedEvent]) -> None:
        await gate.wait()

    seq = Sequencer(store, slow_publish, max_batch=1, max_pending=1, max_delay=0)
    await seq.start()
    try:
        first = await seq.enqueue(commit_event(1))
        # The writer is stuck publishing event 1. Behind it the pipeline holds event 2 (numbered,
        # handed to the committer), event 3 (numbered, waiting to be handed over) and event 4
        # (queued: max_pending=1); the enqueuers of events 5.. are held back for good.
        tasks = [asyncio.create_task(seq.enqueue(commit_event(n))) for n in range(2, 12)]
        await until(lambda: sum(t.done() for t in tasks) == 3, "events 2-4 taken in")
        # (three is all the pipeline can take while publishing is stuck: the rest wait for room)
        blocked = [t for t in tasks if not t.done()]
        assert len(blocked) == 7 and not seq._has_room.is_set(), "max_pending did not hold enqueuers back"
        closing = asyncio.create_task(seq.close())
        await until(lambda: seq._closed, "close() begun")
        gate.set()
        await asyncio.wait_for(closing, 10)
        assert (await first) is not None
        for task in blocked:
            with pytest.raises(SequencerClosedError, match="^sequencer stopped: closed$"):
                await asyncio.wait_for(task, 10)
    finally:
        gate.set()
        await seq.close()


# --- number_batch itself (pure: the decisions above, item by item) ------------------------------

async def test_number_batch_decides_each_item() -> None:
    """One batch of every kind of item: seqs follow ``base`` without holes, a re-delivery (not newer
    than the stored head, or than an event earlier in the batch) and a fenced-off item are not
    numbered, a refused body gives its seq to the next event, host cursors only move forward, and
    event times are ``now`` + 1 µs per event."""
    from backfill.numbering import CursorOnly, number_batch
    from firehose.framing import encode_unsequenced, frame_header, splice_seq
    from firehose.state import Fence

    loop = asyncio.get_running_loop()
    revoked, poisoned_fence = Fence(), Fence()
    revoked.revoke("earlier event lost")
    account = AccountState("did:plc:b", host="h1", rev="3b")
    stamped = AccountState("did:plc:c", host="h1", rev="3c", updated_at=7.0)
    body_cbor, offset = encode_unsequenced({"repo": "did:plc:c", "rev": "3c"})
    items = [
        PendingEvent("#commit", "did:plc:a", {"n": 1}, rev="3a", host="h1", upstream_seq=5,  # head "3a": old
                     collections={"app.bsky.feed.like": 2}),
        PendingEvent("#commit", "did:plc:b", {"n": 2}, rev="3b", account=account, host="h1", upstream_seq=7),
        PendingEvent("#commit", "did:plc:b", {"n": 3}, rev="3b", host="h1", upstream_seq=6),  # same rev again
        CursorOnly("h2", 9),
        CursorOnly("h2", 4),
        PendingEvent("#commit", "did:plc:x", {"n": 4}, fence=revoked),
        PendingEvent("#commit", "did:plc:y", {"n": 6}, fence=revoked),
        CursorOnly("h3", 0),  # the cursor of a host that sent nothing yet stays 0, never 1
        PendingEvent("#identity", "did:plc:p", {"poison": True}, fence=poisoned_fence),
        PendingEvent("#commit", "did:plc:c", {}, rev="3c", account=stamped, body_cbor=body_cbor, seq_offset=offset),
        PendingEvent("#identity", "did:plc:a", {"n": 5}, host="h1"),  # a host but no upstream seq
        PendingEvent("#identity", "did:plc:d", {"n": 7}, host="h5", upstream_seq=1,  # a new host's first
                     collections={"app.bsky.feed.post": 3}),
        PendingEvent("#identity", "did:plc:q", {"poison": True}),  # a second refused body
    ]

    def encode(kind: str, body: dict) -> bytes:
        if body.get("poison"):
            raise ValueError("cannot encode")
        return encode_frame(kind, body)

    futures = [loop.create_future() for _ in items]
    out = await number_batch(list(zip(items, futures, strict=True)), {"did:plc:a": ("h1", "3a")},
                             base=100, now=50.0000004, encode=encode)
    assert out.seq == 104
    assert [(r[0], r[1], r[2], r[3]) for r in out.rows] == [
        (101, "did:plc:b", "#commit", 50.0), (102, "did:plc:c", "#commit", 50.000001),
        (103, "did:plc:a", "#identity", 50.000002), (104, "did:plc:d", "#identity", 50.000003)]
    assert out.rows[0][4] == encode_frame("#commit", {"n": 2, "seq": 101})
    assert out.rows[1][4] == splice_seq(body_cbor, 102, frame_header("#commit"), offset)
    assert out.rows[2][4] == encode_frame("#identity", {"n": 5, "seq": 103})
    assert [(e.seq, e.did, e.kind, e.time, e.frame) for e in out.sequenced] == [tuple(r) for r in out.rows]
    assert [(f, None if e is None else e.seq) for f, e in out.results] == [
        (futures[0], None), (futures[1], 101), (futures[2], None), (futures[3], None), (futures[4], None),
        (futures[7], None), (futures[9], 102), (futures[10], 103), (futures[11], 104)]
    assert [f for f, _ in out.errors] == [futures[5], futures[6], futures[8], futures[12]]
    assert all(isinstance(e, FencedOffError) and "earlier event lost" in str(e) for _, e in out.errors[:2])
    assert isinstance(out.errors[2][1], ValueError) and isinstance(out.errors[3][1], ValueError)
    assert (poisoned_fence.valid, poisoned_fence.reason) == (False, "encode_error")
    assert (out.ignored, out.encode_errors, out.fenced) == (2, 2, 2)
    assert out.cursors == {"h1": 7, "h2": 9, "h3": 0, "h5": 1}
    assert out.revved == {"did:plc:b", "did:plc:c"}
    assert out.last_rev == {"did:plc:a": "3a", "did:plc:b": "3b", "did:plc:c": "3c"}
    assert out.accounts == {"did:plc:b": account, "did:plc:c": stamped}
    assert (account.updated_at, stamped.updated_at) == (50.0000004, 7.0)  # set only when unset
    assert out.last_time == 50.000003
    assert out.collections.resets == {"did:plc:d": {"app.bsky.feed.post": 3}}  # numbered events' only


async def test_number_batch_stops_below_the_seq_limit_and_with_nothing_numbered() -> None:
    """The seq space ends below 2**53: the event that would reach it fails with its fence revoked,
    and ``seq`` stays at ``base``; a batch that numbers nothing keeps ``last_time == now``."""
    from backfill.errors import SeqExhaustedError
    from backfill.numbering import number_batch
    from backfill.store import SEQ_LIMIT
    from firehose.state import Fence

    loop = asyncio.get_running_loop()
    fence = Fence()
    fut, then = loop.create_future(), loop.create_future()
    out = await number_batch([(PendingEvent("#identity", "did:plc:a", {}, fence=fence), fut),
                              (PendingEvent("#identity", "did:plc:b", {}), then)], {},
                             base=SEQ_LIMIT - 1, now=3.0, encode=encode_frame)
    assert out.seq == SEQ_LIMIT - 1 and out.rows == [] and out.last_time == 3.0
    assert [f for f, _ in out.errors] == [fut, then]  # every item is answered, each with its error
    assert all(isinstance(e, SeqExhaustedError) for _, e in out.errors)
    assert (fence.valid, fence.reason) == (False, SeqExhaustedError.reason)
    last = await number_batch([(PendingEvent("#identity", "did:plc:a", {}), loop.create_future())], {},
                              base=SEQ_LIMIT - 2, now=3.0, encode=encode_frame)
    assert last.seq == SEQ_LIMIT - 1 and len(last.rows) == 1  # the last seq there is


async def test_number_batch_records_the_frames_above_their_batchs_cursor() -> None:
    """``upstream_done`` holds ``(host, frame seq)`` of the numbered ``#identity``/``#account``
    events whose frame is above the cursor the batch stores for their host (strictly: a frame at
    the cursor is covered by it; a host without a cursor in the batch counts from 0); not a
    commit's (its rev tells a re-read), nor one without a host or a frame seq, nor one not
    numbered (fenced off, refused by the encoder)."""
    from backfill.numbering import number_batch
    from firehose.state import Fence

    loop = asyncio.get_running_loop()
    revoked = Fence()
    revoked.revoke("earlier event lost")
    items = [
        PendingEvent("#identity", "did:plc:a", {}, host="h1", upstream_seq=3, frame_seq=5),  # above: kept
        PendingEvent("#account", "did:plc:b", {}, host="h1", upstream_seq=4, frame_seq=6),  # above: kept
        PendingEvent("#account", "did:plc:c", {}, host="h2", upstream_seq=8, frame_seq=8),  # at the cursor
        PendingEvent("#identity", "did:plc:d", {}, host="h2", upstream_seq=2, frame_seq=7),  # below h2's 8
        PendingEvent("#commit", "did:plc:e", {}, rev="3e", host="h1", upstream_seq=3, frame_seq=9),  # a commit
        PendingEvent("#identity", "did:plc:f", {}, frame_seq=9),  # no host
        PendingEvent("#identity", "did:plc:g", {}, host="h1", upstream_seq=3),  # no frame seq
        PendingEvent("#identity", "did:plc:h", {}, host="h3", frame_seq=1),  # no cursor for h3: above 0
        PendingEvent("#account", "did:plc:i", {}, host="h4", frame_seq=0),  # no cursor for h4: at 0
        PendingEvent("#identity", "did:plc:j", {}, host="h1", frame_seq=10, fence=revoked),  # fenced off
        PendingEvent("#identity", "did:plc:k", {"poison": True}, host="h1", frame_seq=11),  # refused
    ]

    def encode(kind: str, body: dict) -> bytes:
        if body.get("poison"):
            raise ValueError("cannot encode")
        return encode_frame(kind, body)

    out = await number_batch([(item, loop.create_future()) for item in items], {}, base=0, now=1.0, encode=encode)
    assert out.seq == 9
    assert out.cursors == {"h1": 4, "h2": 8}
    assert out.upstream_done == [("h1", 5), ("h1", 6), ("h3", 1)]


async def test_number_batch_writes_accounts_without_an_event() -> None:
    """An ``AccountWrite`` takes no seq: its state is kept for the batch (stamped with ``now`` when
    it has no time) and its submitter is answered with no event; the items after it are numbered."""
    from backfill.numbering import AccountWrite, number_batch

    loop = asyncio.get_running_loop()
    unstamped = AccountState("did:plc:u", host="h1", sync_state="desynchronized")
    stamped = AccountState("did:plc:s", host="h1", sync_state="throttled", updated_at=7.0)
    futures = [loop.create_future() for _ in range(3)]
    items = [AccountWrite(unstamped), AccountWrite(stamped), PendingEvent("#identity", "did:plc:e", {})]
    out = await number_batch(list(zip(items, futures, strict=True)), {}, base=10, now=20.5, encode=encode_frame)
    assert out.accounts == {"did:plc:u": unstamped, "did:plc:s": stamped}
    assert (unstamped.updated_at, stamped.updated_at) == (20.5, 7.0)
    assert [(f, None if e is None else e.seq) for f, e in out.results] == [
        (futures[0], None), (futures[1], None), (futures[2], 11)]
    assert out.seq == 11 and [r[0] for r in out.rows] == [11]


async def test_number_batch_yields_while_encoding_a_long_batch() -> None:
    """Every 128 items the batch lets other tasks run (the commit in flight keeps streaming)."""
    from backfill.numbering import number_batch

    loop = asyncio.get_running_loop()
    ran: list[int] = []
    items = [(PendingEvent("#identity", f"did:plc:{i}", {}), loop.create_future()) for i in range(300)]
    seen_at: list[int] = []

    def encode(kind: str, body: dict) -> bytes:
        seen_at.append(len(ran))
        return encode_frame(kind, body)

    async def other() -> None:
        while True:
            ran.append(len(seen_at))
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    try:
        out = await number_batch(items, {}, base=0, now=1.0, encode=encode)
    finally:
        task.cancel()
    assert out.seq == 300
    assert ran[1:] == [127, 255]  # the other task ran before items 128 and 256 were encoded


async def test_events_stored_above_their_watermark_are_recorded_for_a_re_read(store: Store) -> None:
    """The host cursor an event carries is its run's watermark, below its own frame: an
    ``#identity``/``#account`` stored above it is recorded (``upstream_done``) in the same batch, so
    a re-read after a crash skips it; a commit is not (a re-read one is known by its rev), and
    neither is an event whose frame the batch's cursor already covers."""
    async with Sequencer(store, Collector()) as seq:
        ident = PendingEvent("#identity", "did:plc:i", {"did": "did:plc:i"}, host="pds.example",
                             upstream_seq=3, frame_seq=5)
        commit = commit_event(6, did="did:plc:c")
        commit.upstream_seq, commit.frame_seq = 3, 6
        account = PendingEvent("#account", "did:plc:a", {"did": "did:plc:a", "active": True}, host="pds.example",
                               upstream_seq=8, frame_seq=7)
        for event in (ident, commit):
            await seq.submit(event)
        assert await store.upstream_done_above("pds.example", 0) == [5]
        await seq.submit(account)  # its frame is below the cursor stored with it: nothing to record
    assert await store.host_cursor("pds.example") == 8
    assert await store.upstream_done_above("pds.example", 0) == [5]


async def test_a_lease_not_taken_again_during_an_outage_loses_no_batch(store: Store) -> None:
    """The store goes away; reconnecting, the old lease's connection is dead (released) and taking
    a new one fails too while the store is still away. The held batch is not failed for want of a
    lease: once the store answers the lease is taken again and the batch is written, once."""
    faults = Faults(RuntimeError("unused"))
    published = Collector()
    seq = Sequencer(with_faults(store, faults), published, retry_base=0.001, retry_max=0.002)
    await seq.start()
    try:
        faults.down = True
        faults.lease_failures, faults.acquire_failures = 1, 1
        held = asyncio.ensure_future(seq.submit(commit_event(1)))
        await until(lambda: faults.acquire_failures == 0 and faults.refused >= 1, "the lease to be lost")
        faults.down = False
        event = await asyncio.wait_for(held, 10)
        assert event is not None and event.seq == 1
        assert seq.stats.failed_batches == 0 and seq.state == "running"
        assert [e.seq for e in await store.read_after(0, 10)] == [1]
        assert [e.seq for e in published.events] == [1]
    finally:
        faults.down = False
        await seq.close()


async def test_a_fatal_stop_fails_everything_behind_it_with_its_cause(store: Store) -> None:
    """Another writer moves the mark while batch k commits: k's submitter gets that error; the
    batch numbered behind k and handed to the committer, the one numbered and waiting to be handed
    over, and the submit still queued all get ``SequencerClosedError`` naming the cause, each
    with its fence revoked; nothing of them is stored."""
    faults = Faults(SequencerConflictError("the mark moved"))
    faults.trigger = lambda batch: True
    seq = Sequencer(with_faults(store, faults), Collector(), max_batch=1)
    await seq.start()
    try:
        held = await seq.enqueue(commit_event(1))
        await asyncio.wait_for(faults.reached.wait(), 10)  # batch k held in its commit
        runs = [Fence() for _ in range(3)]
        behind = [await seq.enqueue(replace(commit_event(n), fence=run)) for n, run in zip((2, 3, 4), runs, strict=True)]
        await until(lambda: seq._next_high_water == 3 and len(seq._pending) == 1,
                    "k+1 handed to the committer, k+2 numbered, k+3 queued")
        faults.go.set()
        with pytest.raises(SequencerConflictError, match="^the mark moved$"):
            await held
        for fut in behind:
            with pytest.raises(SequencerClosedError, match="^sequencer stopped: the mark moved$"):
                await asyncio.wait_for(fut, 10)
        assert [(run.valid, run.reason) for run in runs] == [(False, "sequencer_closed")] * 3
        assert seq.state == "failed" and await store.read_after(0, 10) == []
    finally:
        faults.go.set()
        with contextlib.suppress(Exception):
            await seq.close()


async def test_a_submit_collected_as_the_sequencer_stops_is_failed_not_numbered(store: Store) -> None:
    """A submit taken from the queue just after another writer stopped the sequencer (it arrived
    while batch k was committing, and k was refused as the writer gathered it into a batch) is
    failed with the cause, its fence revoked, and the writer ends."""
    faults = Faults(SequencerConflictError("the mark moved"))
    faults.trigger = lambda batch: True
    seq = Sequencer(with_faults(store, faults), Collector())  # max_delay > 0: gathering yields
    await seq.start()
    try:
        held = await seq.enqueue(commit_event(1))
        await asyncio.wait_for(faults.reached.wait(), 10)  # batch k held in its commit
        run = Fence()
        late = seq.enqueue_nowait(replace(commit_event(2), fence=run))
        faults.go.set()  # the committer stops the sequencer before the writer has gathered `late`
        with pytest.raises(SequencerConflictError):
            await held
        with pytest.raises(SequencerClosedError, match="^sequencer stopped: the mark moved$"):
            await asyncio.wait_for(late, 10)
        assert (run.valid, run.reason) == (False, "sequencer_closed")
        assert seq._next_high_water == 1  # `late` was never numbered
        await seq.close()
        assert seq.state == "failed" and await store.read_after(0, 10) == []
    finally:
        faults.go.set()
        with contextlib.suppress(Exception):
            await seq.close()


async def test_a_standby_follows_the_holder_and_logs_its_wait(target: StoreTarget, store: Store,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """While it waits for the lease a standby asks who holds it every ``wait_log_interval``
    (here often), names the holder in ``lease_holder`` and in its log records, and once it has
    the lease logs whom it took over from, with how long it waited."""
    caplog.set_level("WARNING", logger="backfill.sequencer")
    other_store = await target.open()
    holders = ["relay-a"]

    async def named() -> str | None:
        return holders[-1]

    other_store.writer_holder = named  # type: ignore[method-assign]
    first = Sequencer(store, Collector())
    await first.start()
    waiter = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=30, wait_log_interval=0.01)
    began = time.monotonic()
    start = asyncio.create_task(waiter.start())
    try:
        await until(lambda: waiter.state == "waiting", "the standby waiting for the lease")
        assert waiter.lease_holder == "relay-a"
        holders.append("relay-b")
        await until(lambda: waiter.lease_holder == "relay-b", "the standby naming the new holder")
        await first.close()
        await asyncio.wait_for(start, 30)
        waited = time.monotonic() - began
        assert waiter.lease_holder is None and waiter.state == "running"
        waits = [r for r in caplog.records if r.getMessage() == "sequencer: waiting for the writer lease (standby)"]
        assert waits[0].__dict__["holder"] == "relay-a" and waits[-1].__dict__["holder"] == "relay-b"
        seconds = [r.__dict__["waited_seconds"] for r in waits]
        assert seconds == sorted(seconds) and 0 <= seconds[0] and seconds[-1] <= waited + 0.05
        [taken] = [r for r in caplog.records if r.getMessage() == "sequencer: writer lease taken"]
        assert taken.__dict__["previous_holder"] == "relay-b"
        assert 0 <= taken.__dict__["waited_seconds"] <= waited + 0.05
    finally:
        await first.close()
        await waiter.close()
        await other_store.close()


async def test_event_times_go_on_from_the_last_stored_one_after_a_restart(store: Store) -> None:
    """The first event takes the clock's time; after a restart whose clock went back, the next
    event is 1 µs after the last stored one (not after an earlier one, not at the clock's time).
    ``last_commit_at`` starts at the start."""
    async with Sequencer(store, Collector(), clock=lambda: 0.5, max_batch=1) as seq:
        first = [await seq.submit(commit_event(n)) for n in (1, 2, 3)]
    times = [e.time for e in first if e]
    assert times[0] == 0.5 and times[-1] == pytest.approx(0.5 + 2e-6, abs=1e-9)
    before = time.monotonic()
    async with Sequencer(store, Collector(), clock=lambda: 0.25) as seq:
        assert before <= seq.last_commit_at <= time.monotonic()
        later = await seq.submit(commit_event(4))
    assert later is not None and later.seq == 4
    assert later.time == pytest.approx(times[-1] + 1e-6, abs=1e-9) and later.time > times[-1]


async def test_a_cancelled_standby_stops_waiting_for_the_lease(target: StoreTarget, store: Store) -> None:
    """Cancelling ``start()`` while it waits for the lease cancels the wait itself: nothing is
    left trying to take the lease, the state is ``stopped``, and the lease, once free, is there for
    whoever asks next."""
    other_store = await target.open()
    first = Sequencer(store, Collector())
    await first.start()
    standby = Sequencer(other_store, Collector(), wait_for_lock=True, lock_timeout=30)
    start = asyncio.create_task(standby.start())
    try:
        await until(lambda: standby.state == "waiting", "the standby waiting for the lease")
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert standby.state == "stopped"
        assert not [t for t in asyncio.all_tasks() if not t.done() and "acquire_writer" in repr(t.get_coro())]
        await first.close()
        async with Sequencer(other_store, Collector()) as second:
            event = await second.submit(commit_event(1))
        assert event is not None and event.seq == 1
    finally:
        await first.close()
        await standby.close()
        await other_store.close()


async def test_a_writer_that_ended_refuses_new_submits(store: Store) -> None:
    """A writer task that ended without ``close()`` or a failure (here: cancelled) leaves the
    sequencer ``stopped``: what was queued is failed, and new submits are refused at once instead
    of queueing for nobody."""
    seq = Sequencer(store, Collector())
    await seq.start()
    try:
        assert await seq.submit(commit_event(1)) is not None  # the writer is running
        assert seq._task is not None
        queued = seq.enqueue_nowait(commit_event(2))
        seq._task.cancel()  # before it takes `queued`
        with contextlib.suppress(asyncio.CancelledError):
            await seq._task
        assert seq.state == "stopped"
        with pytest.raises(SequencerClosedError, match="^sequencer stopped: sequencer is closed$"):
            await queued  # failed, not left waiting
        with pytest.raises(SequencerClosedError, match="^sequencer not running: stopped$"):
            seq.enqueue_nowait(commit_event(2))
        with pytest.raises(SequencerClosedError, match="^sequencer stopped: closed$"):
            await asyncio.wait_for(seq.enqueue(commit_event(2)), 10)
        assert not seq._pending
    finally:
        with contextlib.suppress(asyncio.CancelledError):
            await seq.close()
        await seq.close()


async def test_host_account_count_changes_are_reported_after_each_commit(store: Store) -> None:
    """``on_host_accounts`` gets each committed batch's non-zero account-count changes per host
    (new accounts, an account moving host); a batch that changes no count is not reported, and
    the counts reported add up to the stored ones."""
    reports: list[dict[str, int]] = []
    async with Sequencer(store, Collector(), max_batch=1) as seq:
        seq.on_host_accounts = reports.append
        await seq.submit(commit_event(1, did="did:plc:a"))
        await seq.submit(commit_event(2, did="did:plc:b"))
        await seq.submit(commit_event(3, did="did:plc:a"))  # same host: no change
        await seq.submit(commit_event(4, did="did:plc:a", host="pds.other"))  # moved
        await seq.advance_cursor("pds.example", 5)  # a cursor alone: no change
    assert reports == [{"pds.example": 1}, {"pds.example": 1}, {"pds.example": -1, "pds.other": 1}]
    example, other = await store.get_host("pds.example"), await store.get_host("pds.other")
    assert example is not None and other is not None
    assert (example.account_count, other.account_count) == (1, 1)
