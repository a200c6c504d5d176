"""Admission's host rows: reused for ``HOST_TTL`` (one query per host for a burst of new
accounts), read again after ``forget_host`` (a raised limit) — on both backends."""

from __future__ import annotations

from backfill.store import open_store
from backfill.types import HostState
from relay.admission import HOST_TTL, Admission
from relay.config import RelayConfig
from relay.hosts import HostPolicy
from relay.identity import IdentityResolver
from relay.ssrf import AddressGuard, SafeClient

HOST = "pds.example.com"


async def test_host_rows_reused_within_ttl_and_forgotten_on_demand(database_url: str) -> None:
    store = await open_store(database_url)
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe)
    now = [100.0]
    try:
        await store.migrate()
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=10))
        admission = Admission(store=store, identity=resolver, policy=HostPolicy(RelayConfig()),
                              default_account_limit=100, clock=lambda: now[0])
        assert await admission.admit(HOST, "did:plc:a", None) is not None
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=1))  # lowered elsewhere
        assert await admission.admit(HOST, "did:plc:b", None) is not None  # the row read for "a" still serves
        now[0] += HOST_TTL
        assert await admission.admit(HOST, "did:plc:c", None) is None  # read again: held
        held = await store.get_account("did:plc:c")
        assert held is not None and held.sync_state == "throttled"
        host = await store.get_host(HOST)
        assert host is not None and host.status == "throttled"
        await store.upsert_host(HostState(hostname=HOST, status="active", account_limit=10))
        admission.forget_host(HOST)  # what the host manager's limit_raised does
        assert await admission.admit(HOST, "did:plc:d", None) is not None
    finally:
        await resolver.aclose()
        await safe.aclose()
        await store.close()
