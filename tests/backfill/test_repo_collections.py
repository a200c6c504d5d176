"""listReposByCollection's status filter on both backends: ``repo_collections.active`` (migration
0081) follows the account's two statuses through every path that changes them — a batch that
brings the account and its collections together, a later status change and its undoing, collection
rows written before the account row exists, Spark-style rebuilds (delete + insert), and an
upgrade of a database that already had rows when the migration ran."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from backfill.migrations import discover, split_sqlite_statements
from backfill.store import BatchWrite, Store
from firehose.state import AccountState
from tests.backfill.conftest import StoreTarget

COLL = "app.bsky.feed.post"


def acct(did: str, upstream: str = "active", local: str = "active") -> AccountState:
    return AccountState(did=did, host="pds.example", upstream_status=upstream, local_status=local)


async def commit(store: Store, *, accounts: list[AccountState] | None = None,
                 deltas: list[tuple[str, str, int, int]] | None = None,
                 resets: dict[str, dict[str, int]] | None = None) -> None:
    """One sequencer-style batch (no events) through the writer lease."""
    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        hw = await lease.high_water()
        await lease.commit_batch(BatchWrite(hw, hw, accounts=accounts or [], collection_deltas=deltas or [],
                                            collection_resets=resets or {}))
    finally:
        await lease.release()


async def listed(store: Store, collection: str = COLL) -> list[str]:
    return await store.list_repos_by_collection(collection, None, 500)


async def test_batch_accounts_and_their_collections(store: Store) -> None:
    await commit(store, accounts=[acct("did:plc:a"), acct("did:plc:b", upstream="deactivated"),
                                  acct("did:plc:c", local="takendown")],
                 deltas=[(COLL, d, 1, 0) for d in ("did:plc:a", "did:plc:b", "did:plc:c")])
    assert await listed(store) == ["did:plc:a"]
    # the counts are kept for every account, listed or not
    assert await store.collection_counts("did:plc:b") == {COLL: 1}


async def test_status_changes_hide_and_restore(store: Store) -> None:
    dids = [f"did:plc:{c}" for c in "abcd"]
    await commit(store, accounts=[acct(d) for d in dids],
                 deltas=[(c, d, 2, 0) for d in dids for c in (COLL, "app.bsky.feed.like")])
    assert await listed(store) == dids
    await store.upsert_account(acct("did:plc:b", local="takendown"))
    await commit(store, accounts=[acct("did:plc:c", upstream="suspended")])
    assert await listed(store) == ["did:plc:a", "did:plc:d"]
    assert await listed(store, "app.bsky.feed.like") == ["did:plc:a", "did:plc:d"]
    # a further change that keeps the account inactive keeps it hidden
    await store.upsert_account(acct("did:plc:b", upstream="deactivated", local="takendown"))
    await store.upsert_account(acct("did:plc:b", upstream="deactivated"))
    assert await listed(store) == ["did:plc:a", "did:plc:d"]
    # both statuses active again: listed again, in every collection
    await store.upsert_account(acct("did:plc:b"))
    await commit(store, accounts=[acct("did:plc:c")])
    assert await listed(store) == dids
    assert await listed(store, "app.bsky.feed.like") == dids
    # paging with a cursor and a limit skips hidden rows without losing visible ones
    await store.upsert_account(acct("did:plc:b", local="takendown"))
    assert await store.list_repos_by_collection(COLL, "did:plc:a", 1) == ["did:plc:c"]


async def test_rows_for_an_inactive_account_and_rows_before_the_account(store: Store) -> None:
    await store.upsert_account(acct("did:plc:gone", upstream="deleted"))
    # a new collection row (delta insert, and a full reset as a #sync or rebuild writes) takes the
    # account's current status
    await commit(store, deltas=[(COLL, "did:plc:gone", 1, 0)])
    await commit(store, resets={"did:plc:gone": {"app.bsky.feed.like": 3}})
    assert await listed(store) == [] and await listed(store, "app.bsky.feed.like") == []
    # rows written before the account row exists, then the account arrives inactive
    await commit(store, deltas=[(COLL, "did:plc:late", 1, 0)])
    assert await listed(store) == ["did:plc:late"]
    await store.upsert_account(acct("did:plc:late", local="takendown"))
    assert await listed(store) == []
    # ... or arrives active: listed
    await commit(store, deltas=[(COLL, "did:plc:new", 1, 0)], accounts=[acct("did:plc:new")])
    assert await listed(store) == ["did:plc:new"]


async def _migrate_until(target: StoreTarget, below: int) -> None:
    """Apply this backend's migrations numbered below ``below`` by hand, as an older relay did."""
    migrations = [m for m in discover(target.backend) if m.version < below]
    if target.backend == "sqlite":
        conn = sqlite3.connect(target.url, isolation_level=None)
        try:
            conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
                         " applied_at REAL NOT NULL)")
            for m in migrations:
                for statement in split_sqlite_statements(m.sql):
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_migrations VALUES (?, ?, 0)", (m.version, m.name))
            conn.executemany("INSERT INTO accounts (did, upstream_status, local_status) VALUES (?, ?, ?)",
                             [("did:plc:a", "active", "active"), ("did:plc:b", "active", "takendown")])
            conn.executemany("INSERT INTO repo_collections (collection, did, records) VALUES (?, ?, 1)",
                             [(COLL, "did:plc:a"), (COLL, "did:plc:b")])
        finally:
            conn.close()
        return
    pg = await asyncpg.connect(target.url)
    try:
        await pg.execute(f'CREATE SCHEMA "{target.schema}"; SET search_path TO "{target.schema}"')
        await pg.execute("CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                         " applied_at timestamptz NOT NULL DEFAULT now())")
        for m in migrations:
            await pg.execute(m.sql)
            await pg.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.version, m.name)
        await pg.executemany("INSERT INTO accounts (did, upstream_status, local_status) VALUES ($1, $2, $3)",
                             [("did:plc:a", "active", "active"), ("did:plc:b", "active", "takendown")])
        await pg.executemany("INSERT INTO repo_collections (collection, did, records) VALUES ($1, $2, 1)",
                             [(COLL, "did:plc:a"), (COLL, "did:plc:b")])
    finally:
        await pg.close()


async def test_upgrade_marks_existing_rows(target: StoreTarget, tmp_path: Path) -> None:
    await _migrate_until(target, 81)
    store = await target.open()
    try:
        assert 81 in await store.migrate()
        assert await listed(store) == ["did:plc:a"]
        await store.upsert_account(acct("did:plc:b"))
        assert await listed(store) == ["did:plc:a", "did:plc:b"]
    finally:
        await store.close()


async def test_triggers_work_from_a_session_without_the_schema_on_its_path(pg_target: StoreTarget) -> None:
    """An operator's psql or a bulk COPY writing the relay's tables by qualified name (search_path
    left at its default) fires the triggers, which must still find the relay's tables."""
    store = await pg_target.open()
    try:
        await store.migrate()
        pg = await asyncpg.connect(pg_target.url)
        try:
            schema = f'"{pg_target.schema}"'
            await pg.execute(f"INSERT INTO {schema}.repo_collections (collection, did, records) VALUES ($1, $2, 1)",
                             COLL, "did:plc:x")
            await pg.copy_records_to_table("accounts", schema_name=pg_target.schema, columns=["did", "local_status"],
                                           records=[("did:plc:x", "takendown")])
        finally:
            await pg.close()
        assert await listed(store) == []
    finally:
        await store.close()


async def test_a_delete_never_removes_a_collection_of_an_account_whose_counts_are_not_exact(store: Store) -> None:
    """Counts of an account first seen mid-history are lower bounds: deletes of records the relay
    never counted cannot drop it from a collection it was seen creating a record in."""
    await commit(store, accounts=[acct("did:plc:a")], deltas=[(COLL, "did:plc:a", 1, 1)])  # one create seen
    await commit(store, deltas=[(COLL, "did:plc:a", -1, 0)])  # deletes an old record
    await commit(store, deltas=[(COLL, "did:plc:a", -3, 0)])  # ... and three more in one batch
    assert await listed(store) == ["did:plc:a"]
    assert await store.collection_counts("did:plc:a") == {COLL: 1}
    # a delete in a collection it has no row for adds nothing
    await commit(store, deltas=[("app.bsky.feed.like", "did:plc:a", -1, 0)])
    assert await store.collection_counts("did:plc:a") == {COLL: 1}


async def test_an_account_with_exact_counts_leaves_a_collection_with_its_last_record(store: Store) -> None:
    """A reset (a walk of the whole repository) makes the counts exact: from then on a delete is
    counted as it comes, and the account leaves the collection when its count reaches 0 — also
    in a collection it entered after the walk."""
    await commit(store, accounts=[acct("did:plc:a"), acct("did:plc:b")],
                 resets={"did:plc:a": {COLL: 2}}, deltas=[(COLL, "did:plc:b", 1, 1)])
    await commit(store, deltas=[(COLL, "did:plc:a", -1, 0), (COLL, "did:plc:b", -1, 0)])
    assert await store.collection_counts("did:plc:a") == {COLL: 1}
    await commit(store, deltas=[(COLL, "did:plc:a", -1, 0), ("app.bsky.feed.like", "did:plc:a", 1, 1)])
    assert await listed(store) == ["did:plc:b"]  # a: exact, its last post deleted; b: a lower bound
    assert await store.collection_counts("did:plc:a") == {"app.bsky.feed.like": 1}
    await commit(store, deltas=[("app.bsky.feed.like", "did:plc:a", -1, 0)])
    assert await store.collection_counts("did:plc:a") == {}
    # an empty repository walked is exact too
    await commit(store, resets={"did:plc:b": {}})
    await commit(store, deltas=[(COLL, "did:plc:b", 1, 1)])
    await commit(store, deltas=[(COLL, "did:plc:b", -1, 0)])
    assert await listed(store) == []


async def test_a_record_created_and_deleted_in_one_batch_leaves_no_row(store: Store) -> None:
    """A batch that creates and deletes the same record folds to a delta of 0 with a floor of 0:
    the account holds nothing there, so it gets no row, exact counts or not."""
    await commit(store, accounts=[acct("did:plc:a"), acct("did:plc:b")], resets={"did:plc:a": {}})
    await commit(store, deltas=[(COLL, "did:plc:a", 0, 0), (COLL, "did:plc:b", 0, 0)])
    assert await store.collection_counts("did:plc:a") == {}
    assert await store.collection_counts("did:plc:b") == {}
    assert await listed(store) == []
