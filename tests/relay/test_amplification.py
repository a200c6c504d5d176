"""A host cannot make the relay amplify its frames: a genuine commit padded with 40,000 blocks
nothing references is accepted, counted, and redistributed as the producer's own slice."""

from __future__ import annotations

from typing import Any

from mst import cbor
from mst.car import read_car, write_car
from mst.cid import cid_for_cbor
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, crawl
from tests.waiting import until


async def test_padded_commit_goes_out_without_its_unreferenced_blocks(relay_factory: Any) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=21))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 1}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
            await crawl(relay.url, host.hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: any(e.rev == account.repo.rev for e in evs))
            assert fleet._mix is not None
            res = account.repo.apply_writes(fleet._mix.next_writes(account.repo.record_paths()))
            body = fleet._commit_body(account, res)
            car = read_car(body["blocks"])
            junk = [cbor.encode({"pad": i}) for i in range(40_000)]
            padded = write_car(car.roots, [*car.blocks.items(), *((cid_for_cbor(j), j) for j in junk)])
            assert len(padded) > 40 * len(body["blocks"])
            fleet._queue(host, "#commit", {**body, "blocks": padded}, account.did, rev=res.rev)
            fleet._flush_now()
            await consumer.wait_for(lambda evs: any(e.rev == res.rev for e in evs))
            out = next(e for e in consumer.events if e.rev == res.rev)
            assert read_car(out.body["blocks"]).blocks == car.blocks
            assert len(out.body["blocks"]) <= len(body["blocks"])
            stripped = service.metrics.verdicts.labels(kind="strip", reason="unreferenced_blocks")
            await until(lambda: stripped._value.get() == 1, "the strip counted")
            assert service.metrics.verdicts.labels(kind="accept", reason="ok")._value.get() >= 3
    finally:
        await fleet.stop()
