"""Persisted identities through a running relay, on both backends: a restart resolves nothing
known again; ``#identity``, a signature failure and age each replace the stored row. PLC
requests are counted at the simulator's directory (``fleet.plc.requests``)."""

from __future__ import annotations

import random
import time

from backfill.backends import open_store
from backfill.identities import Identity
from sim import SimConfig, SimFleet
from sim.ident import SigningKey, did_document
from tests.relay.conftest import RelayFactory, RunningRelay
from tests.relay.e2e import Consumer, crawl
from tests.waiting import until, until_async

DAY = 86400.0


def _settings(fleet: SimFleet, **extra: object) -> dict[str, object]:
    return {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "handle_resolver_url": fleet.plc_url,
            "validation_workers": 0, "default_account_limit": 1000, **extra}


def _commits(consumer: Consumer) -> int:
    return sum(1 for e in consumer.events if e.t == "#commit")


async def _stored(relay: RunningRelay, did: str) -> Identity | None:
    assert relay.service.identities is not None
    await relay.service.identities.flush()
    return (await relay.service.store.get_identities([did])).get(did)


async def test_restarted_relay_resolves_no_known_identity(relay_factory: RelayFactory, database_url: str) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=5, seed=21, announce_accounts=False))
    await fleet.start()
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                for host in fleet.hosts:
                    await crawl(relay.url, host.hostname)
                await fleet.generate(80)
                await consumer.wait_for(lambda evs: len(evs) >= 80)
        seen = {t.did for t in fleet.ground_truth}
        assert fleet.plc.requests == len(seen) == 10  # each account resolved once
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            async with Consumer(relay.ws_url) as consumer:
                await fleet.generate(80)
                await consumer.wait_for(lambda evs: _commits(consumer) >= 80)
            assert fleet.plc.requests == 10  # the restarted relay read them all from the database
    finally:
        await fleet.stop()


def _rotate_silently(fleet: SimFleet, seed: int) -> SigningKey:
    """A key rotation the relay hears of only through a signature that no longer verifies."""
    acct = fleet.accounts[0]
    acct.key = acct.repo.key = SigningKey.generate("p256", random.Random(seed))
    fleet.plc.docs[acct.did] = did_document(acct.did, acct.handle, acct.key, acct.host.url)
    return acct.key


async def test_signature_failure_replaces_the_stored_identity(relay_factory: RelayFactory,
                                                              database_url: str) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=22, announce_accounts=False))
    await fleet.start()
    did = fleet.accounts[0].did
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, fleet.hosts[0].hostname)
                await fleet.generate(3)
                await consumer.wait_for(lambda evs: len(evs) >= 3)
                assert fleet.plc.requests == 1
                key = _rotate_silently(fleet, 5)
                await fleet.generate(3)
                await consumer.wait_for(lambda evs: len(evs) >= 6)  # accepted with the new key
            assert relay.service.lanes is not None and relay.service.lanes.identity_refreshes == 1
            assert fleet.plc.requests == 2  # resolved again once
            stored = await _stored(relay, did)
            assert stored is not None and stored.signing_key == key.did_key()
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            async with Consumer(relay.ws_url) as consumer:
                await fleet.generate(2)
                await consumer.wait_for(lambda evs: len(evs) >= 2)
            assert relay.service.lanes is not None and relay.service.lanes.identity_refreshes == 0
            assert fleet.plc.requests == 2  # the restarted relay has the new key from the database
    finally:
        await fleet.stop()


async def test_identity_event_replaces_the_stored_identity(relay_factory: RelayFactory, database_url: str) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=23, announce_accounts=False))
    await fleet.start()
    acct = fleet.accounts[0]
    plc_port = int(fleet.plc_url.rsplit(":", 1)[1])
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            assert relay.service.lanes is not None
            metrics = relay.service.metrics
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, fleet.hosts[0].hostname)
                await fleet.generate(2)
                await consumer.wait_for(lambda evs: len(evs) >= 2)
                old = await _stored(relay, acct.did)
                assert old is not None and old.signing_key == acct.key.did_key()
                # The key rotates and #identity says so while the directory is unreachable: the
                # fresh resolution fails, and the stored row must not be served afterwards. The
                # #identity is not dropped: its lane tries it again until the directory answers.
                await fleet.plc.stop()
                fleet.inject("key_rotation", acct)
                await fleet.generate(0)
                retried = metrics.verdicts.labels(kind="retry", reason="identity_resolution_failed")
                await until(lambda: retried._value.get() >= 1, "the #identity to fail its fresh resolution")
                assert await _stored(relay, acct.did) is None
                assert "#identity" not in [e.t for e in consumer.events]
                await fleet.plc.start("127.0.0.1", plc_port)
                await consumer.wait_for(lambda evs: any(e.t == "#identity" for e in evs))
                retried_doc = await _stored(relay, acct.did)
                assert retried_doc is not None and retried_doc.signing_key == acct.key.did_key()
                await fleet.generate(1)
                await consumer.wait_for(lambda evs: _commits(consumer) >= 3)
                assert relay.service.lanes.identity_refreshes == 0  # no signature failure on an old key
                failed = metrics.verdicts.labels(kind="reject", reason="identity_resolution_failed")
                assert failed._value.get() == 0
                # #identity with the directory up: the row is the new document, handle checked
                fleet.inject("key_rotation", acct)
                await fleet.generate(1)
                await consumer.wait_for(lambda evs: _commits(consumer) >= 4)
                stored = await _stored(relay, acct.did)
                assert stored is not None and stored.signing_key == acct.key.did_key()
                assert stored.handle == acct.handle and stored.handle_verified is True
                assert stored.handle_checked_at is not None and stored.fetched_at > old.fetched_at
                assert relay.service.lanes.identity_refreshes == 0
                assert [e.t for e in consumer.events].count("#identity") == 2
    finally:
        await fleet.stop()


async def test_commit_not_checkable_while_the_directory_is_down_is_covered_by_a_resync(
        relay_factory: RelayFactory, database_url: str) -> None:
    """A known account rotates its key while the DID directory is unreachable: its next commit
    fails the old key and cannot be checked against a fresh document. It is not dropped for good:
    past its retries (none here) the account is desynchronized, and once the directory answers its
    resync emits a ``#sync`` at that commit's rev."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=25, announce_accounts=False))
    await fleet.start()
    acct = fleet.accounts[0]
    plc_port = int(fleet.plc_url.rsplit(":", 1)[1])
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet, identity_retry=0.0)) as relay:
            metrics = relay.service.metrics
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, fleet.hosts[0].hostname)
                await fleet.generate(2)
                await consumer.wait_for(lambda evs: _commits(consumer) >= 2)
                await fleet.plc.stop()
                _rotate_silently(fleet, 7)
                await fleet.generate(1)
                failed = metrics.verdicts.labels(kind="reject", reason="identity_resolution_failed")
                await until(lambda: failed._value.get() >= 1, "the commit's key refresh to fail")
                await fleet.plc.start("127.0.0.1", plc_port)
                await consumer.wait_for(lambda evs: any(e.t == "#sync" for e in evs))
                sync = next(e for e in consumer.events if e.t == "#sync")
                assert sync.body["did"] == acct.did and sync.body["rev"] == acct.repo.rev
                bad = metrics.verdicts.labels(kind="reject", reason="bad_signature")
                assert bad._value.get() == 0  # a valid commit is never called forged
    finally:
        await fleet.stop()


async def test_identity_past_its_age_is_resolved_again(relay_factory: RelayFactory, database_url: str) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=6, seed=24, announce_accounts=False))
    await fleet.start()
    now = time.time()
    aged = {a.did for a in fleet.accounts[:3]}
    store = await open_store(database_url)
    try:
        await store.migrate()
        await store.write_identities([
            Identity(a.did, a.key.did_key(), a.host.url, a.handle, now - 2 * DAY if a.did in aged else now - 60)
            for a in fleet.accounts])
    finally:
        await store.close()
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            async with Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, fleet.hosts[0].hostname)
                await fleet.generate(60)
                await consumer.wait_for(lambda evs: len(evs) >= 60)
            assert {t.did for t in fleet.ground_truth} == {a.did for a in fleet.accounts}
            assert fleet.plc.requests == 3  # the three rows older than a day, once each

            async def refreshed() -> bool:
                rows = [await _stored(relay, did) for did in aged]
                return all(r is not None and r.fetched_at >= now for r in rows)

            await until_async(refreshed, "the aged rows to be replaced")
    finally:
        await fleet.stop()


async def test_a_host_the_account_left_cannot_set_its_status_on_a_stored_identity(
        relay_factory: RelayFactory, database_url: str) -> None:
    """The relay's stored identity (young, so a commit would be judged on it) still names the host
    an account has left; that host sends an ``#account`` deactivation. A status change is judged
    against a *fresh* DID document, which names the new PDS: rejected ``wrong_host``, nothing
    stored or emitted. (Judged on the stored identity, the old host could deactivate an account
    it no longer holds.)"""
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=1, seed=25, announce_accounts=False))
    await fleet.start()
    acct = fleet.accounts[0]
    left = next(h for h in fleet.hosts if h is not acct.host)
    store = await open_store(database_url)
    try:
        await store.migrate()
        await store.write_identities([Identity(acct.did, acct.key.did_key(), left.url, acct.handle, time.time() - 60)])
    finally:
        await store.close()
    try:
        async with relay_factory(database_url=database_url, **_settings(fleet)) as relay:
            verdicts = relay.service.metrics.verdicts
            rejected = verdicts.labels(kind="reject", reason="wrong_host")
            accepted = verdicts.labels(kind="accept", reason="ok")
            await crawl(relay.url, left.hostname)
            fleet._queue(left, "#account", {"did": acct.did, "time": "2026-11-24T00:00:00.000Z", "active": False,
                                            "status": "deactivated"}, acct.did, verdict="reject", reason="wrong_host")
            fleet._flush_now()
            await until(lambda: rejected._value.get() + accepted._value.get() >= 1, "the #account to be judged")
            assert (rejected._value.get(), accepted._value.get()) == (1, 0)
            assert fleet.plc.requests == 1  # judged on the directory's answer, not the stored row
            assert await relay.service.store.get_account(acct.did) is None
    finally:
        await fleet.stop()
