"""Batched replay: one list of frames per store read, written to the socket in one call."""

from __future__ import annotations

import asyncio

import pytest
from websockets.frames import Frame, Opcode

from firehose.broadcast import Broadcaster
from firehose.frames import decode_frame
from firehose.serve_wire import binary_frame_header
from tests.waiting import until

from .conftest import Ingest
from .servers import serve, ws_url
from .test_broadcast import collect

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("transport", ["websockets", "asgi"])
async def test_long_replay_while_publishing_is_complete_ordered_without_duplicates(
    ingest: Ingest, transport: str
) -> None:
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=200)
    stored, published = 2000, 800
    await ingest.add(stored, batch=100)
    await b.start()
    target = stored + published
    try:
        async with serve(b, transport) as hp:
            readers = [
                asyncio.create_task(collect(ws_url(hp, cursor), until_seq=target)) for cursor in (0, 699)
            ]
            await until(lambda: b.consumer_count == 2)
            await ingest.add(published, batch=16)  # published while both are replaying
            got_all, got_tail = await asyncio.gather(*readers)
        assert got_all == list(range(1, target + 1))
        assert got_tail == list(range(700, target + 1))
        assert b.stats.too_slow == 0
    finally:
        await b.close()


async def test_replay_batches_are_one_store_read_each_then_live(ingest: Ingest) -> None:
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=50)
    await ingest.add(120)
    await b.start()
    batches = b.session(0).frame_batches()
    try:
        async with asyncio.timeout(10):
            sizes = [len(await anext(batches)) for _ in range(3)]
            assert sizes == [50, 50, 20]  # 120 stored events, reads of 50
            await ingest.add(30, batch=30)  # live: whatever is queued comes as one list
            live: list[int] = []
            while len(live) < 30:
                live.extend(decode_frame(f).body["seq"] for f in await anext(batches))
        assert live == list(range(121, 151))
    finally:
        await batches.aclose()
        await b.close()
    assert b.consumer_count == 0


@pytest.mark.parametrize("n", [0, 1, 125, 126, 127, 65535, 65536, 300_000])
def test_binary_frame_header_matches_websockets_framing(n: int) -> None:
    payload = b"\x07" * n
    expected = Frame(Opcode.BINARY, payload).serialize(mask=False, extensions=[])
    assert binary_frame_header(n) + payload == expected


async def test_closing_mid_replay_deregisters_and_drops_the_read_ahead(ingest: Ingest) -> None:
    b = Broadcaster(ingest.store, ingest.bus, replay_batch=20)
    await ingest.add(200, batch=50)
    await b.start()
    batches = b.session(0).frame_batches()
    try:
        async with asyncio.timeout(10):
            assert len(await anext(batches)) == 20
            assert b.consumer_count == 1
            reads = [t for t in asyncio.all_tasks() if "read_after" in repr(t.get_coro())]
            assert reads  # the next read was started while this batch was out
            unfinished = [t for t in reads if not t.done()]
            await batches.aclose()
            assert b.consumer_count == 0
            if unfinished:
                await asyncio.wait(unfinished)  # done either way: cancelled, or the read answered
            assert all(t.cancelled() for t in unfinished)  # dropped, not left to finish
    finally:
        await b.close()
