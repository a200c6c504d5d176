"""A host whose frame waits for admission to the ingest budget holds that frame alone outside it
(``Upstreams.waiting_bytes``, ``relay_ingest_buffer_bytes{state="waiting"}``): its connection
reads no whole message ahead (``SubscriberConfig.read_ahead_frames`` 0) and is not read at all
while the frame waits (``HostSubscriber.hold_reads``). One simulator host sends a backlog of giant
frames (5.3 MB each, the ``oversized`` fault); the validation worker is stopped (SIGSTOP, a real
process) so the host's run stops admitting frames (its in-flight bytes are full). The connection
must then hold no whole message and at most the rest of one socket read, where ``websockets``'
default keeps 16 messages and more and a read-ahead of one kept two. Once the worker runs again
every accepted event reaches a consumer exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.server import ServerConnection, serve

from firehose.frames import encode_frame
from firehose.subscriber import HostSubscriber, SubscriberConfig, UpstreamFrame
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, metric_value
from tests.relay.helpers import running_relay
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)

GIANTS = 12


async def test_a_host_waiting_for_the_budget_holds_its_frame_alone_outside_it(tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=31, announce_accounts=False))
    await fleet.start()
    try:
        (host,) = fleet.hosts
        (account,) = fleet.accounts
        await fleet.generate(1)
        for _ in range(GIANTS):
            await fleet.emit("oversized", account)
        await fleet.generate(1)
        giant = max(len(e.frame) for e in host.log.entries)
        assert giant > 5_000_000
        async with running_relay(database_url=str(tmp_path / "relay.sqlite"), allow_insecure_hosts=True,
                                 plc_url=fleet.plc_url, validation_workers=1) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            upstreams = relay.service.upstreams
            pool = relay.service.pool
            assert upstreams is not None and pool is not None
            (worker,) = pool.worker_pids
            os.kill(worker, signal.SIGSTOP)
            try:
                await crawl(relay.url, host.hostname)
                # the run dispatches a giant frame (counted twice its size), then waits for room
                # (the host's in-flight bytes) with the next in hand: it holds the connection's reads
                def state() -> tuple[int, int, int, bool, bool]:
                    run = upstreams._runs.get(host.hostname)
                    ws = None if run is None else run.subscriber._ws
                    if run is None or ws is None:
                        return 0, 0, 0, False, True
                    frames = list(ws.recv_messages.frames.queue)
                    return (len(frames), sum(len(f.data) for f in frames), len(ws.protocol.reader.buffer),
                            run.subscriber.reads_held, ws.transport.is_reading())

                await until(lambda: upstreams.waiting_bytes > 0 and not state()[4],
                            "a giant frame waiting for admission, the connection not reading", timeout=25)
                count, held, partial, reads_held, reading = state()
                assert reads_held and not reading
                waiting = upstreams.waiting_bytes  # the giant frame in hand, counted (2 x its size + 2 KiB)
                assert 2 * 5_000_000 < waiting <= 2 * giant + 2048
                async with httpx.AsyncClient(base_url=relay.url) as http:
                    text = (await http.get("/metrics")).text
                assert metric_value(text, "relay_ingest_buffer_bytes", state="waiting") == waiting
                assert count == 0, f"{count} whole messages read ahead ({held / 1e6:.1f} MB)"
                assert partial <= 256 * 1024, f"{partial} bytes of the next message read"
            finally:
                os.kill(worker, signal.SIGCONT)
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            await consumer.wait_for(lambda evs: len(evs) >= len(wanted), timeout=150)
        assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == Counter(wanted)
        check_stream(consumer.events)
    finally:
        await fleet.stop()


def _big(seq: int, size: int = 1_000_000) -> bytes:
    return encode_frame("#identity", {"seq": seq, "did": "did:plc:abc", "time": "2026-01-01T00:00:00Z",
                                      "pad": b"x" * size})


def _connection_state(sub: HostSubscriber) -> tuple[int, int, bool] | None:
    """Whole messages the connection holds for the subscriber, bytes of the next one it has read
    (its parser's buffer), whether it reads its socket; None: not connected."""
    ws = sub._ws
    if ws is None:
        return None
    return len(ws.recv_messages.frames.queue), len(ws.protocol.reader.buffer), ws.transport.is_reading()


@pytest.mark.parametrize("hold", [False, True], ids=["waiting", "holding"])
async def test_an_owner_that_waits_has_at_most_one_message_read_ahead_and_none_when_it_holds(hold: bool) -> None:
    """While ``on_frame`` is awaited the connection keeps at most one whole message ahead of the
    subscriber (``read_ahead_frames`` 0); none when the owner holds the reads (``hold_reads``),
    and reading goes on once it releases them: every message arrives, in order."""
    messages = 8
    first_taken = asyncio.Event()
    go_on = asyncio.Event()
    got: list[int] = []

    async def handler(conn: ServerConnection) -> None:
        for seq in range(1, messages + 1):
            await conn.send(_big(seq))
        await conn.wait_closed()

    sub: HostSubscriber | None = None

    async def on_frame(uf: UpstreamFrame) -> None:
        assert sub is not None
        got.append(uf.seq)
        if uf.seq == 1:
            if hold:
                sub.hold_reads()
            first_taken.set()
            await go_on.wait()
            if hold:
                sub.release_reads()

    async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        sub = HostSubscriber(f"http://127.0.0.1:{port}", on_frame,
                             config=SubscriberConfig(rate_limits=[], backoff_base=0.01, backoff_max=0.05))
        task = asyncio.create_task(sub.run())
        try:
            await asyncio.wait_for(first_taken.wait(), 20)
            await until(lambda: (s := _connection_state(sub)) is not None and not s[2],
                        "the connection to stop reading", timeout=20)
            state = _connection_state(sub)
            assert state is not None
            queued, partial, _ = state
            assert queued <= (0 if hold else 1), f"{queued} whole messages read ahead"
            assert partial <= 256 * 1024, f"{partial} bytes of the next message read"
            go_on.set()
            await until(lambda: len(got) >= messages, "every message delivered", timeout=30)
            assert got == list(range(1, messages + 1))
        finally:
            await sub.stop()
            await asyncio.wait_for(task, 10)
