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
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.client import connect

from backfill.store import BatchWrite, Store
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from firehose.frames import encode_frame
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
