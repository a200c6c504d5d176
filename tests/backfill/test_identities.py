"""Persisted identities (migration 0090) on both backends: rows, purges, newer-only writes."""

from __future__ import annotations

from backfill.identities import Identity, IdentityPurge
from backfill.store import Store
from tests.backfill.conftest import StoreTarget

ALICE = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"
BOB = "did:plc:bbbbbbbbbbbbbbbbbbbbbbbb"


def _ident(did: str, key: str, at: float, **kw: object) -> Identity:
    return Identity(did, key, "https://pds.example.com", "alice.example.com", at, **kw)  # type: ignore[arg-type]


async def test_identities_round_trip_and_survive_reopening(store: Store, target: StoreTarget) -> None:
    a = _ident(ALICE, "did:key:zA", 1000.0, handle_verified=True, handle_checked_at=1001.5)
    b = Identity(BOB, "did:key:zB", None, None, 1000.0)
    await store.write_identities([a, b])
    assert await store.get_identities([ALICE, BOB, "did:plc:unknown"]) == {ALICE: a, BOB: b}
    other = await target.open()  # another process, or a restarted relay
    try:
        assert await other.get_identities([ALICE]) == {ALICE: a}
    finally:
        await other.close()


async def test_purge_makes_a_miss_and_only_newer_writes_land(store: Store) -> None:
    await store.write_identities([_ident(ALICE, "did:key:zOld", 1000.0)])
    await store.write_identities([IdentityPurge(ALICE, 2000.0)])
    assert await store.get_identities([ALICE]) == {ALICE: None}  # purged, not absent
    # a resolution sent before the purge (here or in another process) must not bring it back
    await store.write_identities([_ident(ALICE, "did:key:zOld", 1500.0)])
    assert await store.get_identities([ALICE]) == {ALICE: None}
    fresh = _ident(ALICE, "did:key:zNew", 2000.0)  # sent at the purge's instant or later: lands
    await store.write_identities([fresh])
    assert await store.get_identities([ALICE]) == {ALICE: fresh}
    await store.write_identities([_ident(ALICE, "did:key:zOld", 1999.0), _ident(BOB, "did:key:zB", 5.0)])
    got = await store.get_identities([ALICE, BOB])
    assert got[ALICE] == fresh and got[BOB] is not None and got[BOB].signing_key == "did:key:zB"
    # the handle check recorded against the same document (same fetched_at) replaces it
    checked = _ident(ALICE, "did:key:zNew", 2000.0, handle_verified=False, handle_checked_at=2001.0)
    await store.write_identities([checked])
    assert (await store.get_identities([ALICE]))[ALICE] == checked


async def test_many_identities_in_one_write(store: Store) -> None:
    rows = [Identity(f"did:plc:{i:024d}", f"did:key:z{i}", None, None, float(i + 1)) for i in range(1200)]
    await store.write_identities(rows)
    got = await store.get_identities(r.did for r in rows)
    assert got == {r.did: r for r in rows}
