"""Admission's host rows: reused for ``HOST_TTL`` (one query per host for a burst of new
accounts), read again after ``forget_host`` (a raised limit) — on both backends. And who may
speak for an account (``identity_for_host``), against the simulator's PLC directory (whose
request count is the measure of "resolved again")."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from backfill.backends import open_store
from backfill.store import Store
from backfill.types import HostState
from relay.config import RelayConfig
from relay.hosts import HostBoard, HostPolicy
from relay.identity import IdentityResolver, MemoryIdentityCache
from relay.ingest.admission import HOST_TTL, Admission
from relay.ssrf import AddressGuard, SafeClient
from sim.ident import SigningKey, did_document, plc_did
from sim.plc import SimPLC

HOST = "pds.example.com"


def _admission(store: Store, resolver: IdentityResolver, default_account_limit: int | None,
               clock: Callable[[], float] = time.monotonic) -> Admission:
    """An admission with a host board of its own (the relay shares one with its host manager)."""
    policy = HostPolicy(RelayConfig())
    return Admission(store=store, identity=resolver, policy=policy, default_account_limit=default_account_limit,
                     clock=clock, board=HostBoard(store, policy))


async def test_host_rows_reused_within_ttl_and_forgotten_on_demand(database_url: str) -> None:
    store = await open_store(database_url)
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe)
    now = [100.0]
    try:
        await store.migrate()
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=10))
        admission = _admission(store, resolver, 100, lambda: now[0])
        assert (await admission.admit(HOST, "did:plc:a", None)).sync_state == "synced"  # type: ignore[union-attr]
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=1))  # lowered elsewhere
        # the row read for "a" still serves
        assert (await admission.admit(HOST, "did:plc:b", None)).sync_state == "synced"  # type: ignore[union-attr]
        now[0] += HOST_TTL
        held = await admission.admit(HOST, "did:plc:c", None)  # read again: held (its lane stores it so)
        assert held is not None and held.sync_state == "throttled" and held.host == HOST
        host = await store.get_host(HOST)
        assert host is not None and host.status == "throttled"
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=10))
        admission.forget_host(HOST)  # what the host manager's limit_raised does
        assert (await admission.admit(HOST, "did:plc:d", None)).sync_state == "synced"  # type: ignore[union-attr]
    finally:
        await resolver.aclose()
        await safe.aclose()
        await store.close()


async def test_a_burst_of_first_seen_accounts_reads_the_host_count_once(database_url: str) -> None:
    """Concurrent first admissions on a host share one count of its stored accounts, and the
    limit still holds exactly across them."""
    store = await open_store(database_url)
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe)
    counted: list[str | None] = []
    count_accounts = store.count_accounts

    async def counting(host: str | None = None) -> int:
        counted.append(host)
        return await count_accounts(host)

    store.count_accounts = counting  # type: ignore[method-assign]
    try:
        await store.migrate()
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=30))
        admission = _admission(store, resolver, 100)
        states = await asyncio.gather(*(admission.admit(HOST, f"did:plc:{i}", None) for i in range(50)))
        assert counted == [HOST]
        assert sum(1 for st in states if st is not None and st.sync_state == "synced") == 30
        assert sum(1 for st in states if st is not None and st.sync_state == "throttled") == 20
    finally:
        await resolver.aclose()
        await safe.aclose()
        await store.close()


async def test_identity_for_host_rechecks_a_disagreeing_answer_once(database_url: str, plc: SimPLC) -> None:
    """The cached DID document decides when it names the host; when it does not, one fresh
    resolution decides (the account may have moved here). ``fresh`` resolves at once (within
    ``max_age`` of the last resolution the cached answer stands). A relay upstream speaks for any
    account whose PDS the relay rule allows (not followed directly, not banned)."""
    rng = random.Random(14)
    did, key = plc_did(rng), SigningKey.generate("k256", rng)
    plc.docs[did] = did_document(did, "a.test", key, "https://old.example.com")
    store = await open_store(database_url)
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url=plc.url, safe_client=safe, cache=MemoryIdentityCache(), rate=10_000,
                                burst=10_000)
    try:
        await store.migrate()
        admission = _admission(store, resolver, None, lambda: 0.0)
        ident = await admission.identity_for_host(did, "old.example.com")
        assert ident is not None and (ident.did, ident.pds_hostname) == (did, "old.example.com")
        assert await admission.identity_for_host(did, "old.example.com") == ident
        assert plc.requests == 1  # the cached document agreed: not resolved again
        plc.docs[did] = did_document(did, "a.test", key, "https://new.example.com")  # moved
        moved = await admission.identity_for_host(did, "new.example.com")
        assert moved is not None and moved.pds_hostname == "new.example.com"
        assert plc.requests == 2
        assert await admission.identity_for_host(did, "old.example.com") is None  # the host it left
        assert plc.requests == 3
        fresh = await admission.identity_for_host(did, "new.example.com", fresh=True)
        assert fresh is not None and fresh.pds_hostname == "new.example.com" and plc.requests == 4
        assert await admission.identity_for_host(did, "old.example.com", fresh=True) is None
        assert plc.requests == 5
        recent = await admission.identity_for_host(did, "new.example.com", fresh=True, max_age=3600.0)
        assert recent is not None and recent.pds_hostname == "new.example.com"
        assert plc.requests == 5  # resolved less than an hour ago: the cached answer stands
        # relay upstreams: the relay rule, not the host name, decides
        assert await admission.identity_for_host(did, "relay.example.org") is None
        requests = plc.requests
        relayed = await admission.identity_for_host(did, "relay.example.org", relay=True)
        assert relayed is not None and relayed.pds_hostname == "new.example.com"
        assert plc.requests == requests  # the cached document passes the relay rule: not resolved again
        assert await admission.identity_for_host(did, "relay.example.org", fresh=True, relay=True) is not None
        await store.add_domain_ban("new.example.com")
        banned = _admission(store, resolver, None, lambda: 0.0)
        assert await banned.identity_for_host(did, "relay.example.org", relay=True) is None
        assert await banned.identity_for_host(did, "relay.example.org", fresh=True, relay=True) is None
        assert await banned.identity_for_host(did, "new.example.com") is not None  # the PDS itself still speaks
        plc.docs[did] = did_document(did, "a.test", key, "https://third.example.com")  # moved off the banned PDS
        requests = plc.requests
        moved_on = await banned.identity_for_host(did, "relay.example.org", relay=True)
        assert moved_on is not None and moved_on.pds_hostname == "third.example.com"  # decided by the fresh one
        assert plc.requests == requests + 1
    finally:
        await resolver.aclose()
        await safe.aclose()
        await store.close()
