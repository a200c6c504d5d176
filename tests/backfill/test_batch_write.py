"""The stores' write path, through the writer lease on both backends: one ``BatchWrite`` moves the
high-water mark and writes its events, accounts, hosts and re-read markers together, or — when the
mark moved — nothing at all."""

from __future__ import annotations

import pytest

from backfill.postgres_store import _PgLease
from backfill.sequencer import SequencerConflictError
from backfill.store import BatchWrite, Store
from firehose.state import AccountState
from tests.backfill.conftest import StoreTarget

DID_A, DID_B = "did:plc:batcha", "did:plc:batchb"


def row(seq: int, did: str = DID_A, size: int = 10) -> tuple[int, str, str, float, bytes]:
    return (seq, did, "#commit", 1_000.0 + seq, bytes([seq % 256]) * size)


async def test_a_batch_writes_everything_and_moves_the_mark(store: Store) -> None:
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        assert await lease.high_water() == 0
        first = BatchWrite(
            0, 3,
            events=[row(1), row(2, DID_B, 20), row(3, size=30)],
            accounts=[AccountState(did=DID_A, host="pds.a", rev="3kaaaaaaaaaa2", updated_at=5.0),
                      AccountState(did=DID_B, host="pds.a", rev="3kaaaaaaaaab2", updated_at=6.0)],
            host_updates={"pds.a": (17, 1_234.5, 2), "pds.b": (None, None, 0)},
            upstream_done=[("pds.a", 19), ("pds.a", 21)],
        )
        await lease.commit_batch(first)
        assert await lease.high_water() == 3
        stored = await store.read_after(0)
        assert [(e.seq, e.did, e.kind, e.time, e.frame) for e in stored] == first.events
        assert await store.latest_seq() == 3 and await store.count_events() == 3
        assert await store.events_bytes() == 60 == first.frame_bytes
        a = await store.get_account(DID_A)
        assert a is not None and (a.host, a.rev) == ("pds.a", "3kaaaaaaaaaa2")
        assert await store.account_heads([DID_A, DID_B]) == {DID_A: ("pds.a", "3kaaaaaaaaaa2"),
                                                            DID_B: ("pds.a", "3kaaaaaaaaab2")}
        assert await store.host_cursor("pds.a") == 17 and await store.host_cursor("pds.b") == 0
        host = await store.get_host("pds.a")
        assert host is not None and host.account_count == 2 and host.last_seen == 1_234.5
        assert await store.upstream_done_above("pds.a", 17) == [19, 21]

        # a second batch adds to what is stored: bytes, counts, the mark; the cursor only moves up
        second = BatchWrite(3, 5, events=[row(4, size=5), row(5, size=7)],
                            host_updates={"pds.a": (16, None, -1)})
        await lease.commit_batch(second)
        assert await lease.high_water() == 5 and await store.latest_seq() == 5
        assert await store.events_bytes() == 72
        host = await store.get_host("pds.a")
        assert host is not None and host.account_count == 1 and host.last_seen == 1_234.5
        assert await store.host_cursor("pds.a") == 17
    finally:
        await lease.release()


async def test_a_batch_numbered_from_a_stale_mark_writes_nothing(store: Store) -> None:
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        await lease.commit_batch(BatchWrite(0, 2, events=[row(1), row(2)]))
        stale = BatchWrite(
            1, 4,
            events=[row(3), row(4)],
            accounts=[AccountState(did=DID_B, host="pds.b")],
            host_updates={"pds.b": (9, 1.0, 1)},
            upstream_done=[("pds.b", 12)],
        )
        with pytest.raises(SequencerConflictError, match="no longer 1"):
            await lease.commit_batch(stale)
        assert await lease.high_water() == 2
        assert [e.seq for e in await store.read_after(0)] == [1, 2]
        assert await store.events_bytes() == 20
        assert await store.get_account(DID_B) is None and await store.get_host("pds.b") is None
        assert await store.upstream_done_above("pds.b", 0) == []
        # the same batch from the stored mark goes through
        await lease.commit_batch(BatchWrite(2, 4, events=[row(3), row(4)]))
        assert [e.seq for e in await store.read_after(0)] == [1, 2, 3, 4]
    finally:
        await lease.release()


async def test_a_batch_without_events_moves_only_what_it_carries(store: Store) -> None:
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        await lease.commit_batch(BatchWrite(0, 1, events=[row(1)]))
        await lease.commit_batch(BatchWrite(1, 1, accounts=[AccountState(did=DID_A, host="pds.a")]))
        assert await lease.high_water() == 1 and await store.events_bytes() == 10
        assert await store.account_heads([DID_A]) == {DID_A: ("pds.a", None)}
    finally:
        await lease.release()


async def test_a_released_lease_writes_nothing(store: Store) -> None:
    lease = await store.acquire_writer(wait=True, timeout=10)
    await lease.commit_batch(BatchWrite(0, 1, events=[row(1)]))
    await lease.release()
    await lease.release()  # idempotent
    with pytest.raises(Exception):  # noqa: B017,PT011  (SQLite: SequencerConflictError; Postgres: its closed connection)
        await lease.commit_batch(BatchWrite(1, 2, events=[row(2)]))
    assert await store.latest_seq() == 1
    again = await store.acquire_writer(wait=True, timeout=10)  # the lease was given up
    try:
        assert await again.high_water() == 1
    finally:
        await again.release()


async def test_postgres_stages_accounts_once_per_lease_and_inserts_only_new_ones(pg_target: StoreTarget) -> None:
    """Postgres writes a batch's accounts through a temporary staging table made once per lease
    connection, one UPDATE for those that exist and an INSERT only when some are new."""
    store = await pg_target.open()
    await store.migrate()
    lease = await store.acquire_writer(wait=True, timeout=10)
    assert isinstance(lease, _PgLease)
    statements: list[str] = []
    lease._conn.add_query_logger(lambda q: statements.append(q.query.split()[0].upper()))

    async def batch(*accounts: AccountState) -> list[str]:
        statements.clear()
        await lease.commit_batch(BatchWrite(0, 0, accounts=list(accounts)))
        return [s for s in statements if s in ("CREATE", "UPDATE", "INSERT")]

    try:
        assert await batch(AccountState(did=DID_A, host="pds.a", rev="r1"),
                           AccountState(did=DID_B, host="pds.a", rev="r1")) == ["UPDATE", "CREATE", "UPDATE", "INSERT"]
        assert await batch(AccountState(did=DID_A, host="pds.b", rev="r2"),
                           AccountState(did=DID_B, host="pds.b", rev="r2")) == ["UPDATE", "UPDATE"]
        assert await batch(AccountState(did=DID_B, host="pds.c", rev="r3"),
                           AccountState(did="did:plc:batchc", host="pds.c", rev="r3")) == ["UPDATE", "UPDATE", "INSERT"]
        assert await store.account_heads([DID_A, DID_B, "did:plc:batchc"]) == {
            DID_A: ("pds.b", "r2"), DID_B: ("pds.c", "r3"), "did:plc:batchc": ("pds.c", "r3")}
    finally:
        await lease.release()
        await store.close()
