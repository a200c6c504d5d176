"""The consumer library against the real relay and simulated hosts: verified events, restart."""

from __future__ import annotations

import asyncio

from firehose.consumer import Event, FileCursorStore, RelayConsumer, verified
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, crawl


async def test_verified_events_and_resume_without_gap(relay_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=4))
    await fleet.start()
    try:
        keys = {a.did: a.key.did_key() for a in fleet.accounts}

        async def signing_key(did: str) -> str:
            return keys[did]

        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(**settings) as relay:
            base = relay.url.replace("http://", "ws://")
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(30)
            async with Consumer(relay.ws_url, cursor=0) as truth:
                want = sum(1 for t in fleet.ground_truth if t.verdict == "accept")
                await truth.wait_for(lambda evs: len(evs) >= want)
            store = FileCursorStore(tmp_path / "cursor")
            first = RelayConsumer(base, cursor_store=store, cursor=0, signing_key=signing_key, save_interval=0.0)
            got: list[Event] = []
            async with first:
                async with asyncio.timeout(30):
                    async for ev in verified(first):
                        got.append(ev)
                        first.done(ev)
                        if len(got) == 20:
                            break
            assert await store.load() == got[-1].seq  # the last seq applied: the stream resumes after it
            commits = [e for e in got if e.kind == "#commit"]
            assert commits and all(e.verdict is not None and e.verdict.kind == "accept" for e in commits)
            await fleet.generate(10)
            want = sum(1 for t in fleet.ground_truth if t.verdict == "accept")
            second = RelayConsumer(base, cursor_store=store)
            async with second:
                async with asyncio.timeout(30):
                    async for ev in second:
                        got.append(ev)
                        second.done(ev)
                        if len(got) == want:
                            break
            assert [e.seq for e in got] == list(range(1, want + 1))  # no gap, no duplicate
            assert second.duplicates_dropped == 0  # resuming after the saved seq: the relay resent nothing
            # a tampered commit does not verify
            raw = bytearray(commits[-1].raw)
            raw[-10] ^= 0xFF
            tampered = Event("#commit", commits[-1].seq, commits[-1].did, commits[-1].body, bytes(raw))
            checker = RelayConsumer(base, signing_key=signing_key)
            verdict = await checker.verify(tampered)
            assert verdict is not None and verdict.kind != "accept"
    finally:
        await fleet.stop()
