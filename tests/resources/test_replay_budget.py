"""The replay budget under a crowd, over real sockets (README, "Memory budgets"): every consumer
replaying the window at once shares one budget in bytes. More replaying consumers each wait longer,
the bytes they hold together never exceed the budget, and a replaying consumer that stops reading
is cut so that it cannot keep the others waiting.

The broadcaster runs as the relay serves it (uvicorn with ``firehose.uvicorn_batch``) over a real
SQLite store; what is measured is the budget's own accounting (``BroadcastStats.replay_budget_peak``),
not the process's memory. Frames are all exactly ``FRAME`` bytes, so every read's expected size is
its real size and the bound is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from websockets.asyncio.client import connect

from backfill.store import BatchWrite, Store
from firehose.broadcast import CONSUMER_TOO_SLOW, Broadcaster, BroadcastStats, ConsumerSession, ReplayBudget
from firehose.bus import InProcessBus
from firehose.frames import decode_frame, encode_frame
from firehose.state import SequencedEvent
from tests.firehose.servers import serve, ws_url
from tests.firehose.test_broadcast import collect
from tests.waiting import until

DID = "did:plc:replaycrowd00000000000000"


def frame_of(seq: int, size: int) -> bytes:
    """A ``#commit`` frame of exactly ``size`` bytes (the payload makes up for the seq's encoding)."""
    base = len(encode_frame("#commit", {"seq": seq, "repo": DID, "blocks": b"x" * 300}))
    frame = encode_frame("#commit", {"seq": seq, "repo": DID, "blocks": b"x" * (300 + size - base)})
    assert len(frame) == size
    return frame


async def write_window(store: Store, n: int, size: int) -> None:
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        for start in range(1, n + 1, 50):
            seqs = range(start, min(start + 50, n + 1))
            await lease.commit_batch(BatchWrite(expected_high_water=start - 1, new_high_water=seqs[-1],
                                                events=[(s, DID, "#commit", time.time(), frame_of(s, size))
                                                        for s in seqs]))
    finally:
        await lease.release()


class GatedStore:
    """The store, with every replay read held until ``gate`` opens (so a whole crowd is replaying
    before the first read answers)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.gate = asyncio.Event()

    async def read_after(self, seq: int, limit: int = 1000) -> list[SequencedEvent]:
        await self.gate.wait()
        return await self._store.read_after(seq, limit)

    async def oldest_seq(self) -> int | None:
        return await self._store.oldest_seq()

    async def latest_seq(self) -> int | None:
        return await self._store.latest_seq()


@pytest.mark.parametrize("clients", [12, 24])
async def test_a_replay_crowd_shares_the_budget_and_never_holds_more(store: Store, clients: int) -> None:
    """``clients`` consumers replay a 120-event window at once; each gets all of it, in order; the
    bytes held for replay never exceed the budget, and everything is given back. The budget holds
    8 frames and every read at least one: with the store's answers held until the whole crowd is
    replaying, its first reads alone do not fit, so some wait in line whatever the order of arrival."""
    frame, events, limit = 4096, 120, 8 * 4096
    await write_window(store, events, frame)
    gated = GatedStore(store)
    b = Broadcaster(gated, InProcessBus(), replay_batch=16, replay_bytes=16 * frame, replay_budget_bytes=limit)
    await b.start()
    try:
        async with serve(b, "asgi-batch") as hp:
            readers = [asyncio.create_task(collect(ws_url(hp, 0), until_seq=events)) for _ in range(clients)]
            await until(lambda: b.replaying == clients, "the whole crowd replaying")
            gated.gate.set()
            got = await asyncio.wait_for(asyncio.gather(*readers), 60)
        assert all(seqs == list(range(1, events + 1)) for seqs in got)
        assert 0 < b.stats.replay_budget_peak <= limit
        assert b.stats.replay_waits > 0  # the crowd did not fit at once: reads waited their turn
        assert b.replay_budget.used == 0 and b.replaying == 0
    finally:
        await b.close()


@contextlib.asynccontextmanager
async def stalled_replayer(b: Broadcaster, hp: str, limit: int) -> AsyncIterator[None]:
    """A consumer replaying from cursor 0 that stops reading: a small receive buffer, reads paused.
    Entered once it is stuck, its batch with the connection and its read ahead done: it holds the
    whole replay budget (``limit``)."""
    host, port = hp.split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    async with connect(ws_url(hp, 0), sock=sock, max_queue=1, max_size=None) as stalled:
        stalled.transport.pause_reading()
        await until(lambda: b.replay_budget.used == limit and any(
            s.replay_stalled_since is not None for s in b.sessions), "a stalled replayer holding the budget")
        yield

async def test_a_stalled_replayer_is_cut_so_the_others_replay(store: Store) -> None:
    """A consumer replays, then stops reading: it holds the whole budget (its batch and its read
    ahead). Consumers that come after wait in line until it has taken nothing for ``max_lag``; then
    it is cut (``ConsumerTooSlow``), gives its bytes back, and they get the whole window."""
    frame, events = 32 * 1024, 200  # ~6.5 MB: more than a stalled socket's buffers take
    limit = 4 * frame
    await write_window(store, events, frame)
    b = Broadcaster(store, InProcessBus(), replay_batch=2, replay_bytes=2 * frame, replay_budget_bytes=limit,
                    max_lag=1.0)
    await b.start()
    try:
        async with serve(b, "asgi-batch") as hp:
            async with stalled_replayer(b, hp, limit):
                healthy = [asyncio.create_task(collect(ws_url(hp, 0), until_seq=events)) for _ in range(2)]
                got = await asyncio.wait_for(asyncio.gather(*healthy), 60)
            assert all(seqs == list(range(1, events + 1)) for seqs in got)
            assert b.stats.replay_stalled == 1 and b.stats.too_slow == 1
        assert b.stats.replay_budget_peak <= limit
    finally:
        await b.close()


async def test_a_replaying_session_holds_its_reads_as_frames_alone(store: Store) -> None:
    """While a subscribeRepos consumer's replay batch is with its connection and its next read is
    done (the whole budget held), the session holds those reads as their frames alone: no event
    object of them is alive. (Each event's small objects, held for as long as a read waits, are
    what a replay crowd left behind in CPython's small-object arenas, which are never given back
    while any block in them lives.)"""
    frame, events = 32 * 1024, 200
    limit = 4 * frame
    await write_window(store, events, frame)
    gc.collect()
    # events other tests of this process left alive are not this session's: held here, set aside
    earlier = [o for o in gc.get_objects() if isinstance(o, SequencedEvent)]
    earlier_ids = {id(o) for o in earlier}
    b = Broadcaster(store, InProcessBus(), replay_batch=2, replay_bytes=2 * frame, replay_budget_bytes=limit,
                    max_lag=60.0)
    await b.start()
    try:
        async with serve(b, "asgi-batch") as hp:
            async with stalled_replayer(b, hp, limit):
                gc.collect()
                alive = sum(1 for o in gc.get_objects() if isinstance(o, SequencedEvent) and id(o) not in earlier_ids)
                assert alive == 0, f"{alive} replayed events held as objects"
    finally:
        await b.close()


async def test_the_budget_is_at_least_one_byte() -> None:
    """A one-byte budget is a budget (its limit reported); a zero-byte one is refused, saying why."""
    stats = BroadcastStats()
    budget = ReplayBudget(1, stats)
    assert budget.limit == 1 and stats.replay_budget_limit == 1
    await budget.take(1)
    assert budget.used == 1
    with pytest.raises(ValueError, match=r"^the replay budget must be at least one byte$"):
        ReplayBudget(0, BroadcastStats())


async def test_reads_of_sessions_holding_nothing_go_before_reads_ahead() -> None:
    """With the budget full, a read ahead that arrived first waits behind a session's first read
    (``take`` without ``ahead`` is that line); each wait is counted and reported once; what is held
    and the most ever held are the stats'."""
    stats = BroadcastStats()
    waits: list[int] = []
    budget = ReplayBudget(10, stats, on_wait=lambda: waits.append(stats.replay_waits))
    await budget.take(10)
    assert (stats.replay_budget_used, stats.replay_budget_peak) == (10, 10)
    order: list[str] = []

    async def reader(name: str, n: int, ahead: bool | None) -> None:
        await (budget.take(n) if ahead is None else budget.take(n, ahead=ahead))
        order.append(name)

    ahead = asyncio.create_task(reader("ahead", 6, True))
    await until(lambda: budget.waiting == 1, "the read ahead in line")
    first = asyncio.create_task(reader("first", 6, None))
    await until(lambda: budget.waiting == 2, "the first read in line")
    assert stats.replay_waits == 2 and waits == [1, 2] and order == []
    budget.give(10)  # room for one of them: the first read
    await first
    assert order == ["first"] and not ahead.done() and budget.used == 6
    assert (stats.replay_budget_used, stats.replay_budget_peak) == (6, 10)
    budget.give(6)
    await ahead
    assert order == ["first", "ahead"] and stats.replay_budget_used == 6 and stats.replay_waits == 2
    third = asyncio.create_task(reader("third", 4, False))  # fits: no wait
    await third
    assert (stats.replay_budget_used, stats.replay_budget_peak, stats.replay_waits) == (10, 10, 2)
    budget.give(7)
    assert (stats.replay_budget_used, stats.replay_budget_peak) == (3, 10)


async def test_a_read_settles_on_its_real_size() -> None:
    """A read taken at its expected size is held at its real size: more is kept (the line waits
    for it), less is given back at once (a waiting read may then go)."""
    stats = BroadcastStats()
    budget = ReplayBudget(20, stats)
    await budget.take(8)
    budget.settle(8, 15)
    assert budget.used == 15 and stats.replay_budget_used == 15 and stats.replay_budget_peak == 15
    waiting = asyncio.create_task(budget.take(10))
    await until(lambda: budget.waiting == 1, "a read in line")
    budget.settle(15, 9)  # 9 held: the waiting read's 10 fits
    await waiting
    assert budget.used == 19 and stats.replay_budget_used == 19
    budget.settle(10, 10)
    assert budget.used == 19 and stats.replay_budget_peak == 19


class VirtualTime:
    """A broadcaster's clock and sleep: the time is what the test sets, and each sleep lasts
    until the test steps it."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.asked: list[float] = []
        self._sleeps: list[asyncio.Future[None]] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.asked.append(delay)
        self._sleeps.append(fut)
        await fut

    @property
    def sleeping(self) -> int:
        return sum(1 for f in self._sleeps if not f.done())

    def step(self) -> None:
        """Every sleep asked for so far ends."""
        for f in self._sleeps:
            if not f.done():
                f.set_result(None)


async def test_stalled_replayers_are_cut_at_max_lag_whenever_a_read_waits(store: Store) -> None:
    """Replaying sessions whose connection has held their batch for ``max_lag`` (not a moment
    less) are cut, each counted, once a read waits for the budget they hold; the waiting read then
    goes. The check is made as soon as a read starts to wait, every time, not only while an
    earlier watch is still pacing."""
    frame = 1000
    await write_window(store, 20, frame)
    t = VirtualTime(100.0)
    b = Broadcaster(store, InProcessBus(), replay_batch=1, replay_bytes=frame, replay_budget_bytes=4 * frame,
                    max_lag=10.0, clock=t.clock, sleep=t.sleep)
    opened: list[AsyncGenerator[list[SequencedEvent], None]] = []
    pending: list[asyncio.Future[list[SequencedEvent]]] = []

    async def replayer(used: int | None) -> tuple[ConsumerSession, AsyncGenerator[list[SequencedEvent], None],
                                                  asyncio.Future[list[SequencedEvent]]]:
        """A session replaying from cursor 0; ``used``: its first batch is handed over and the
        budget holds that much (its read ahead done); None: its first read waits in line."""
        s = b.session(0)
        batches = s.event_batches()
        opened.append(batches)
        first = asyncio.ensure_future(anext(batches))
        pending.append(first)
        if used is None:
            await until(lambda: b.replay_budget.waiting == 1, "a read waiting", timeout=5)
        else:
            assert [e.seq for e in await asyncio.wait_for(first, 10)] == [1]
            await until(lambda: b.replay_budget.used == used, "the read ahead done", timeout=5)
        return s, batches, first

    try:
        one, one_batches, _ = await replayer(2 * frame)  # handed at 100
        two, two_batches, _ = await replayer(4 * frame)  # handed at 100: the budget is full
        assert b.stats.replay_waits == 0
        t.now = 109.99
        three, _, three_first = await replayer(None)
        await until(lambda: t.sleeping == 1, "the stall watch pacing", timeout=5)
        assert not one.too_slow.is_set() and not two.too_slow.is_set() and b.stats.replay_stalled == 0
        t.now = 110.0
        t.step()
        await until(lambda: one.too_slow.is_set() and two.too_slow.is_set(), "the stalled two cut", timeout=5)
        assert b.stats.replay_stalled == 2 and b.stats.too_slow == 2 and not three.too_slow.is_set()
        assert one.close_frame is not None
        cut = decode_frame(one.close_frame)
        assert cut.error == CONSUMER_TOO_SLOW
        assert cut.body.get("message") == "took no replay batch for 10 s while others waited to replay"
        await one_batches.aclose()  # what their transports do: the bytes they held come back
        await two_batches.aclose()
        assert [e.seq for e in await asyncio.wait_for(three_first, 10)] == [1]  # handed at 110
        await until(lambda: b.replay_budget.used == 2 * frame, "its read ahead done", timeout=5)
        t.step()  # nobody waits: the watch ends
        t.now = 120.0
        four, _, _ = await replayer(4 * frame)  # handed at 120
        assert t.sleeping == 0
        await replayer(None)  # waits: the third, stalled for 10 s, is cut at once
        await until(lambda: three.too_slow.is_set(), "the third cut", timeout=5)
        assert not four.too_slow.is_set() and b.stats.replay_stalled == 3 and b.stats.replay_waits == 2
        for first in pending:  # every session gone, mid-replay: everything held is given back
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
        for batches in opened:
            await batches.aclose()
        assert b.replay_budget.used == 0 and b.stats.replay_budget_used == 0 and b.replaying == 0
    finally:
        for batches in opened:
            with contextlib.suppress(Exception):
                await batches.aclose()
        await b.close()


async def test_a_read_asks_for_an_equal_share_of_half_the_budget(store: Store) -> None:
    """A replay read asks for ``replay_bytes``, or less once the replaying sessions could not each
    hold two reads: half the budget divided by them (whole bytes, at least one)."""
    b = Broadcaster(store, InProcessBus(), replay_bytes=5000, replay_budget_bytes=12_000)
    shares = []
    for replaying in (0, 1, 2, 3, 5):
        b.replaying = replaying
        shares.append(b.read_share())
    assert shares == [5000, 5000, 3000, 2000, 1200] and all(type(s) is int for s in shares)
    tiny = Broadcaster(store, InProcessBus(), replay_bytes=5000, replay_budget_bytes=1)
    assert tiny.read_share() == 1


async def test_a_session_closed_mid_replay_gives_back_all_it_held(store: Store) -> None:
    """A session that replayed a few batches of frames of different sizes, then went away with
    one batch at its connection and its read ahead done, gives back exactly what it held."""
    sizes = {seq: 1000 + 150 * seq for seq in range(1, 9)}
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        await lease.commit_batch(BatchWrite(expected_high_water=0, new_high_water=8, events=[
            (s, DID, "#commit", time.time(), frame_of(s, n)) for s, n in sizes.items()]))
    finally:
        await lease.release()
    b = Broadcaster(store, InProcessBus(), replay_batch=1, replay_bytes=4000, replay_budget_bytes=40_000)
    batches = b.session(0).event_batches()
    got: list[int] = []
    for _ in range(3):
        got += [e.seq for e in await asyncio.wait_for(anext(batches), 10)]
    assert got == [1, 2, 3]
    await until(lambda: b.replay_budget.used == sizes[3] + sizes[4], "the read ahead done", timeout=5)
    await batches.aclose()
    assert b.replay_budget.used == 0 and b.replaying == 0
    await b.close()


async def test_a_first_read_expects_the_frames_last_read(store: Store) -> None:
    """A session's first read expects frames of the size the broadcaster last read (its limit
    follows); before any read, ``replay_bytes / replay_batch`` each, at least one byte."""
    await write_window(store, 20, 1000)
    b = Broadcaster(store, InProcessBus(), replay_batch=100, replay_bytes=4000)
    for expected in (list(range(1, 21)), [1, 2, 3, 4]):  # 40-byte frames expected, then 1000
        batches = b.session(0).event_batches()
        assert [e.seq for e in await asyncio.wait_for(anext(batches), 10)] == expected
        await batches.aclose()
    tiny = Broadcaster(store, InProcessBus(), replay_batch=10, replay_bytes=10)  # 1 byte a frame
    batches = tiny.session(0).event_batches()
    assert [e.seq for e in await asyncio.wait_for(anext(batches), 10)] == list(range(1, 11))
    await batches.aclose()


async def test_a_first_read_goes_before_a_read_ahead_that_waited_longer(store: Store) -> None:
    """The budget holds one read: a session's read ahead waits, then another session's first
    read; when the budget is given back, the first read goes first."""
    frame = 1000
    await write_window(store, 6, frame)
    b = Broadcaster(store, InProcessBus(), replay_batch=1, replay_bytes=frame, replay_budget_bytes=frame)
    one, two = b.session(0).event_batches(), b.session(0).event_batches()
    pending: list[asyncio.Future[list[SequencedEvent]]] = []
    try:
        assert [e.seq for e in await asyncio.wait_for(anext(one), 10)] == [1]
        await until(lambda: b.replay_budget.waiting == 1, "its read ahead in line", timeout=5)
        first_two = asyncio.ensure_future(anext(two))
        await until(lambda: b.replay_budget.waiting == 2, "the other's first read in line", timeout=5)
        next_one = asyncio.ensure_future(anext(one))  # its batch taken: its bytes come back
        pending += [first_two, next_one]
        assert [e.seq for e in await asyncio.wait_for(first_two, 5)] == [1]
        assert not next_one.done()  # its read ahead still waits (now behind the other's)
    finally:
        for fut in pending:
            fut.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await fut
        await one.aclose()
        await two.aclose()
        await b.close()
