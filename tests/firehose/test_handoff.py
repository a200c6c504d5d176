"""The replay→live handoff when the store is ahead of the bus: a consumer replays events the bus
has not delivered yet; when the bus delivers them after the switch, none goes out twice (the
duplicate filter of the queued path and of the direct-write path, each at its ``<=`` boundary)."""

from __future__ import annotations

import time

import pytest
from websockets.asyncio.client import connect

from backfill.store import BatchWrite, Store
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from firehose.frames import decode_frame
from firehose.state import SequencedEvent
from tests.waiting import until

from .conftest import DID, commit_frame
from .servers import serve, ws_url

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["websockets", "asgi-batch"])
async def test_late_bus_delivery_of_replayed_events_is_not_sent_again(store: Store, transport: str) -> None:
    bus = InProcessBus()
    b = Broadcaster(store, bus, replay_batch=10)
    await b.start()
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        def event(seq: int) -> SequencedEvent:
            return SequencedEvent(seq, DID, "#commit", time.time(), commit_frame(seq))

        async def write(events: list[SequencedEvent]) -> None:
            await lease.commit_batch(BatchWrite(events[0].seq - 1, events[-1].seq,
                                                events=[(e.seq, e.did, e.kind, e.time, e.frame) for e in events]))

        late = [event(s) for s in range(1, 31)]
        await write(late)  # in the store, not yet on the bus
        async with serve(b, transport) as hp, connect(ws_url(hp, cursor=0), max_size=None) as ws:
            assert [decode_frame(await ws.recv()).body["seq"] for _ in range(30)] == list(range(1, 31))
            await until(lambda: len(b.sessions) == 1 and b.sessions[0].live, "the switch to live")
            marker = event(31)
            await write([marker])
            await bus.publish(late[:29])  # the bus catches up after the switch: all already sent...
            await bus.publish([late[29], marker])  # ...then a batch starting at the last seq sent
            assert decode_frame(await ws.recv()).body["seq"] == 31  # nothing in between, nothing lost
            session = b.sessions[0]
            assert (session.sent, session.last_seq) == (31, 31)
            assert session.bytes_sent == sum(len(commit_frame(s)) for s in range(1, 32))
    finally:
        await lease.release()
        await b.close()
