"""Upstream host → subscriber → validation pipeline → sequencer (real store) → bus →
broadcaster → downstream consumer, all over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import ServerConnection, serve

from backfill.sequencer import Sequencer
from backfill.store import Store
from backfill.types import HostState
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from firehose.frames import decode_frame, encode_frame
from firehose.pipeline import ValidationPool
from firehose.state import PendingEvent
from firehose.subscriber import HostSubscriber, SubscriberConfig, UpstreamFrame

from .commits import commit_body, flip_sig, new_repo, posts
from .servers import serve_plain, ws_url

pytestmark = pytest.mark.timeout(90)


async def test_events_flow_end_to_end_and_cursor_follows_durability(store: Store) -> None:
    repos = [new_repo(f"did:plc:endtoend{i:017d}") for i in range(3)]
    upstream: list[bytes] = []
    expected_blocks: list[bytes] = []
    for k in range(4):
        for repo in repos:
            res = repo.genesis if k == 0 else repo.apply_writes(posts(2, start=10 * k))
            body = commit_body(repo, res, seq=len(upstream) + 1)
            if k == 2 and repo is repos[1]:
                upstream.append(encode_frame("#commit", flip_sig(body)))  # forged: must not pass
                continue
            upstream.append(encode_frame("#commit", body))
            expected_blocks.append(res.car)
    # after the forged one, repos[1]'s next commit no longer chains (it skipped one): desync
    last_upstream = len(upstream)

    async def host(conn: ServerConnection) -> None:
        for f in upstream:
            await conn.send(f)
        await conn.wait_closed()

    keys = {r.did: r.key.did_key() for r in repos}
    bus = InProcessBus()
    server = await serve(host, "127.0.0.1", 0)
    hostname = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await store.upsert_host(HostState(hostname=hostname))
    verdicts = []
    async with Sequencer(store, bus.publish) as seqr, ValidationPool(2) as pipeline:
        broadcaster = Broadcaster(store, bus)
        await broadcaster.start()

        async def on_frame(f: UpstreamFrame) -> None:
            did = f.frame.body.get("repo") or f.frame.body.get("did")
            stored = await store.get_account(did)
            v = await pipeline.judge(f.raw, stored, keys[did])
            verdicts.append(v)
            if v.kind == "accept":
                body = {k: val for k, val in f.frame.body.items() if k != "seq"}
                await seqr.submit(PendingEvent(f.frame.t, did, body, body["rev"], v.new_state, hostname, f.seq))
            else:
                if v.new_state is not None:
                    await store.upsert_account(v.new_state)
                await seqr.advance_cursor(hostname, f.seq)
            sub.ack(f.seq)  # only after the sequencer made it durable

        sub = HostSubscriber(f"http://{hostname}", on_frame, config=SubscriberConfig(rate_limits=[(1000, 1.0)]))
        task = asyncio.create_task(sub.run())
        async with serve_plain(broadcaster) as hp:
            from websockets.asyncio.client import connect

            got = []
            async with connect(ws_url(hp, 0)) as ws:
                async with asyncio.timeout(30):
                    while len(got) < 10:
                        got.append(decode_frame(await ws.recv()))
                    while sub.cursor != last_upstream:
                        await asyncio.sleep(0.01)
        await sub.stop()
        await task
        await broadcaster.close()
    server.close()
    await server.wait_closed()

    kinds = [(v.kind, v.reason) for v in verdicts]
    assert kinds.count(("reject", "bad_signature")) == 1
    assert kinds.count(("desync", "since_mismatch")) == 1
    assert kinds.count(("accept", "ok")) == 10
    assert [f.body["seq"] for f in got] == list(range(1, 11))  # our own seq, no gaps
    accepted_blocks = [f.body["blocks"] for f in got]
    assert all(b in expected_blocks for b in accepted_blocks)  # CAR bytes passed through verbatim
    assert await store.host_cursor(hostname) == last_upstream
    desynced = await store.get_account(repos[1].did)
    assert desynced is not None and desynced.sync_state == "desynchronized"
