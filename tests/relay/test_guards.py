"""Guards a change could remove with every other test still green (each was tried): a repair must
check the repository's signature, and a handle must be verified before it is passed on."""

from __future__ import annotations

from typing import Any

from sim import SimConfig, SimFleet
from sim.ident import SigningKey
from tests.relay.e2e import Consumer, crawl
from tests.waiting import until


def _count(metric: Any, **labels: str) -> float:
    return metric.labels(**labels)._value.get()  # type: ignore[no-any-return]


async def test_resync_refuses_a_repository_signed_with_another_key(relay_factory: Any) -> None:
    """The PDS serves a repository whose head is signed by a key the DID document does not name
    (a forged repository): the repair fails ``commit_bad_signature``, nothing is announced, and
    the account stays desynchronized at what the relay verified last."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=31))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service = relay.service
            account, other = fleet.accounts
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(6)
            await consumer.wait_for(lambda evs: any(e.rev == account.repo.rev for e in evs))
            verified_rev = account.repo.rev
            assert fleet._mix is not None
            forger = SigningKey.generate("k256", fleet.rng)
            account.repo.apply_writes(fleet._mix.next_writes(account.repo.record_paths()), sign_with=forger)
            await service.lanes.mark_for_resync(account.did, fleet.hosts[0].hostname)
            await until(lambda: _count(service.metrics.resyncs, result="commit_bad_signature") >= 1,
                        "the forged repository refused")
            marker = await service.lanes.set_local_status(other.did, "takendown")  # an #account marker
            await consumer.wait_for(lambda evs: any(e.t == "#account" and e.did == other.did for e in evs))
            assert marker.local_status == "takendown"
            assert not [e for e in consumer.events if e.t == "#sync" and e.did == account.did]
            stored = await service.store.get_account(account.did)
            assert stored is not None and stored.rev == verified_rev and stored.sync_state == "desynchronized"
    finally:
        await fleet.stop()


async def test_identity_handle_is_passed_on_only_when_it_resolves_back(relay_factory: Any) -> None:
    """Two ``#identity`` events from the account's own PDS: its real handle (the directory's
    resolveHandle names the DID) is passed on; a handle that resolves to nothing is stripped and
    counted ``strip``/``handle_not_verified``, the event itself still redistributed."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=32))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                    "handle_resolver_url": fleet.plc_url}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
            await crawl(relay.url, host.hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: any(e.rev == account.repo.rev for e in evs))
            stripped_before = _count(service.metrics.verdicts, kind="strip", reason="handle_not_verified")
            for handle, when in ((account.handle, "2026-11-24T00:00:01.000Z"),
                                 ("not-this-account.example.com", "2026-11-24T00:00:02.000Z")):
                fleet._queue(host, "#identity", {"did": account.did, "time": when, "handle": handle}, account.did)
                fleet._flush_now()
                await consumer.wait_for(lambda evs, when=when: any(e.t == "#identity" and e.body.get("time") == when
                                                                   for e in evs))
            real, unverified = [next(e for e in consumer.events if e.t == "#identity" and e.body.get("time") == w)
                                for w in ("2026-11-24T00:00:01.000Z", "2026-11-24T00:00:02.000Z")]
            assert real.body.get("handle") == account.handle
            assert "handle" not in unverified.body and unverified.did == account.did
            assert _count(service.metrics.verdicts, kind="strip", reason="handle_not_verified") == stripped_before + 1
    finally:
        await fleet.stop()
