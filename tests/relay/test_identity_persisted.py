"""Persisted identities under the resolver, on both backends, against the simulator's PLC
directory (``sim.plc``, whose request count is the measure of "resolved again").

End-to-end through a running relay: ``tests/relay/test_identity_refresh.py``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from backfill.backends import open_store
from backfill.store import Store
from relay.identity import IdentityError, IdentityResolver, MemoryIdentityCache
from relay.identity_store import PersistedIdentities
from relay.metrics import RelayMetrics
from relay.ssrf import AddressGuard, SafeClient
from sim.ident import SigningKey, did_document, plc_did
from sim.plc import SimPLC

PDS = "http://127.0.0.1:9"
DAY = 86400.0


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def safe() -> AsyncIterator[SafeClient]:
    client = SafeClient(AddressGuard())
    yield client
    await client.aclose()


async def _store(database_url: str) -> Store:
    store = await open_store(database_url)
    await store.migrate()
    return store


def _register(plc: SimPLC, n: int, seed: int = 1) -> list[tuple[str, SigningKey]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        did, key = plc_did(rng), SigningKey.generate("k256", rng)
        plc.docs[did] = did_document(did, f"u{i}.test", key, PDS)
        out.append((did, key))
    return out


def _resolver(plc_url: str, safe: SafeClient, persisted: PersistedIdentities, **kw: object) -> IdentityResolver:
    return IdentityResolver(plc_url=plc_url, safe_client=safe, cache=MemoryIdentityCache(), persisted=persisted,
                            rate=10_000, burst=10_000, **kw)  # type: ignore[arg-type]


async def test_restarted_resolver_reads_through_without_resolving(database_url: str, plc: SimPLC,
                                                                  safe: SafeClient) -> None:
    accounts = _register(plc, 40)
    store = await _store(database_url)
    persisted = PersistedIdentities(store)
    persisted.start()
    first = _resolver(plc.url, safe, persisted)
    try:
        resolved = await asyncio.gather(*(first.resolve(did) for did, _ in accounts))
        assert [i.signing_key for i in resolved] == [k.did_key() for _, k in accounts]
        assert plc.requests == 40
    finally:
        await first.aclose()
        await persisted.close()  # a clean stop flushes what is queued
        await store.close()

    store = await _store(database_url)  # the restarted relay (or a new fan-out replica)
    persisted = PersistedIdentities(store)
    metrics = RelayMetrics()
    second = _resolver(plc.url, safe, persisted, metrics=metrics)
    try:
        again = await asyncio.gather(*(second.resolve(did) for did, _ in accounts))
        assert again == resolved
        assert plc.requests == 40  # nothing resolved again
        assert persisted.reads == 1  # the 40 lookups of one loop turn shared one query
        assert metrics.identity_cache.labels(result="stored")._value.get() == 40
        await second.resolve(accounts[0][0])
        assert persisted.reads == 1  # then served from memory
    finally:
        await second.aclose()
        await persisted.close()
        await store.close()


async def test_identity_past_its_age_is_resolved_again(database_url: str, plc: SimPLC, safe: SafeClient) -> None:
    [(did, key)] = _register(plc, 1)
    clock = Clock()
    store = await _store(database_url)
    persisted = PersistedIdentities(store)
    try:
        first = await _resolver(plc.url, safe, persisted, clock=clock).resolve(did)
        assert first.fetched_at == clock.now and plc.requests == 1
        await persisted.flush()
        clock.now += DAY - 1  # young: a fresh process reads it from the store
        assert await _resolver(plc.url, safe, persisted, clock=clock, stale_after=DAY).resolve(did) == first
        assert plc.requests == 1
        clock.now += 2  # older than a day: resolved again, and the row follows
        rotated = SigningKey.generate("p256", random.Random(5))
        plc.docs[did] = did_document(did, "u0.test", rotated, PDS)
        again = await _resolver(plc.url, safe, persisted, clock=clock, stale_after=DAY).resolve(did)
        assert plc.requests == 2 and again.signing_key == rotated.did_key() and again.fetched_at == clock.now
        await persisted.flush()
        assert (await store.get_identities([did]))[did] == again
    finally:
        await persisted.close()
        await store.close()


async def test_old_identity_used_while_the_directory_is_unreachable(database_url: str, plc: SimPLC,
                                                                    safe: SafeClient) -> None:
    [(did, key), (gone, _)] = _register(plc, 2)
    clock = Clock()
    store = await _store(database_url)
    persisted = PersistedIdentities(store)
    metrics = RelayMetrics()
    try:
        live = _resolver(plc.url, safe, persisted, clock=clock)
        await live.resolve(did)
        await live.resolve(gone)
        await persisted.flush()
        clock.now += 3 * DAY
        down = _resolver("http://127.0.0.1:9", safe, persisted, clock=clock, metrics=metrics, stale_after=DAY)
        kept = await down.resolve(did)  # the directory does not answer: the old identity serves
        assert kept.signing_key == key.did_key()
        assert metrics.identity_cache.labels(result="stale_served")._value.get() == 1
        with pytest.raises(IdentityError):  # a fresh resolution asked for the directory: no fallback
            await down.resolve(did, fresh=True)
        # a directory that answers "no such DID" is final: the row is purged, not served
        del plc.docs[gone]
        with pytest.raises(IdentityError) as err:
            await _resolver(plc.url, safe, persisted, clock=clock, stale_after=DAY).resolve(gone)
        assert err.value.reason == "did_not_found"
        assert (await store.get_identities([gone])) == {gone: None}
    finally:
        await persisted.close()
        await store.close()


async def test_purge_is_stored_before_it_returns(database_url: str, plc: SimPLC, safe: SafeClient) -> None:
    [(did, key)] = _register(plc, 1)
    store = await _store(database_url)
    persisted = PersistedIdentities(store)
    other_store = await _store(database_url)  # another replica on the same database
    other = PersistedIdentities(other_store)
    try:
        resolver = _resolver(plc.url, safe, persisted)
        await resolver.resolve(did)
        await persisted.flush()
        assert (await other.get(did)) is not None
        rotated = SigningKey.generate("k256", random.Random(9))
        plc.docs[did] = did_document(did, "renamed.test", rotated, PDS)
        await resolver.purge(did)  # as on #identity, before the fresh resolution
        assert (await other_store.get_identities([did])) == {did: None}
        replica = _resolver(plc.url, safe, other)
        assert (await replica.resolve(did)).signing_key == rotated.did_key()  # not the old row
        assert plc.requests == 2
    finally:
        await persisted.close()
        await other.close()
        await store.close()
        await other_store.close()


async def test_store_outage_costs_resolutions_never_a_purged_row(database_url: str, plc: SimPLC,
                                                                 safe: SafeClient) -> None:
    [(did, _), (other_did, _)] = _register(plc, 2)
    store = await _store(database_url)
    persisted = PersistedIdentities(store)
    resolver = _resolver(plc.url, safe, persisted)
    try:
        await resolver.resolve(did)
        await persisted.flush()
        await store.close()  # every read and write of the store fails from now on
        await resolver.purge(did)  # does not raise: queued, and hidden from reads meanwhile
        assert await persisted.get(did) is None
        assert await persisted.get(other_did) is None  # a failed read is a miss
        assert not await persisted.flush()
        assert (await resolver.resolve(other_did)).did == other_did  # from the network
        assert plc.requests == 2
        # the retry lands the queued purge and the new identity once the store is back
        persisted.store = await _store(database_url)
        assert await persisted.flush()
        rows = await persisted.store.get_identities([did, other_did])
        assert rows[did] is None and rows[other_did] is not None
    finally:
        await resolver.aclose()
        await persisted.close()
        await persisted.store.close()
