"""The store core (``backfill.sql_store``) on both backends: default page sizes, the values a
write keeps that the round trips of ``test_store.py`` do not read back, and the flags read from
rows (SQLite keeps them as integers)."""

from __future__ import annotations

import sqlite3
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from backfill.backends import open_store
from backfill.store import BatchWrite, Store
from backfill.types import HostState
from firehose.state import AccountState
from tests.backfill.conftest import StoreTarget


async def _rows(target: StoreTarget, statement: str) -> list[tuple[Any, ...]]:
    """Every row of one raw read against the target (what another reader of the table sees)."""
    if target.backend == "postgres":
        conn = await asyncpg.connect(target.url, server_settings={"search_path": target.schema or "public"})
        try:
            return [tuple(r) for r in await conn.fetch(statement)]
        finally:
            await conn.close()
    db = sqlite3.connect(target.url, timeout=30)
    try:
        return db.execute(statement).fetchall()
    finally:
        db.close()


def _numbers(n: int) -> str:
    """A recursive CTE ``n(i)`` of 1..n, read alike by both dialects."""
    return f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n}) "


async def test_default_page_sizes(store: Store, target: StoreTarget) -> None:
    """A call without ``limit`` returns the ``Store`` contract's page: 500 accounts, hosts, repos of
    a collection or outbox rows, 200 audit entries, 1000 events."""
    blob = "decode('00', 'hex')" if target.backend == "postgres" else "x'00'"
    await target.sql(_numbers(501) + "INSERT INTO accounts (did, host, sync_state, updated_at) "
                     "SELECT 'did:plc:' || (10000 + i), NULL, 'desynchronized', 1 FROM n")
    await target.sql(_numbers(501) + "INSERT INTO hosts (hostname) SELECT 'h' || (10000 + i) || '.example' FROM n")
    await target.sql(_numbers(501) + "INSERT INTO repo_collections (collection, did, records) "
                     "SELECT 'app.bsky.feed.post', 'did:plc:' || (10000 + i), 1 FROM n")
    await target.sql(_numbers(501) + "INSERT INTO spark_repair_outbox (dedupe_key, kind, did, created_at) "
                     "SELECT 'k' || i, 'commit', 'did:plc:' || (10000 + i), 1 FROM n")
    await target.sql(_numbers(201) + "INSERT INTO admin_audit (time, action, target, detail) "
                     "SELECT i, 'block_host', 'h' || i, '{}' FROM n")
    await target.sql(_numbers(1001) + f"INSERT INTO events (seq, did, kind, time, frame) "
                     f"SELECT i, 'did:plc:a', 'commit', 1, {blob} FROM n")
    assert len(await store.list_accounts()) == 500
    assert len(await store.accounts_by_sync_state("desynchronized")) == 500
    assert len(await store.list_hosts()) == 500
    assert len(await store.list_repos_by_collection("app.bsky.feed.post")) == 500
    assert len(await store.pending_repairs()) == 500
    assert len(await store.list_admin_actions()) == 200
    assert len(await store.read_after(0)) == 1000


async def test_host_flags_and_last_seen_read_back(store: Store) -> None:
    """``trusted`` comes back as its own flag (not another column's truth value), as a bool on both
    backends; a given ``last_seen`` is stored, and an upsert without one keeps it."""
    await store.upsert_host(HostState("pds.example", trusted=False, rate_limit_per_second=50, last_seen=123.5))
    await store.upsert_host(HostState("relay.example", trusted=True, relay=True, lenient=False))
    got = await store.get_host("pds.example")
    assert got is not None
    assert got.trusted is False and got.relay is False and got.lenient is None
    assert (got.rate_limit_per_second, got.last_seen) == (50, 123.5)
    other = await store.get_host("relay.example")
    assert other is not None
    assert other.trusted is True and other.relay is True and other.lenient is False
    await store.upsert_host(HostState("pds.example", trusted=True))
    got = await store.get_host("pds.example")
    assert got is not None and got.trusted is True and got.last_seen == 123.5


async def test_list_hosts_from_the_start_includes_every_name(store: Store) -> None:
    """The first page starts before every hostname, those that begin with a digit included."""
    names = ["0.example", "127.0.0.1", "a.example"]
    for name in names:
        await store.upsert_host(HostState(name))
    assert [h.hostname for h in await store.list_hosts()] == names


async def test_a_consumed_repair_keeps_its_seq_and_outcome(store: Store, target: StoreTarget) -> None:
    """``mark_repair_consumed`` writes what the relay did (``outcome``, read by the Spark side's
    report) and the event the row became."""
    for n in (1, 2):
        await target.sql("INSERT INTO spark_repair_outbox (dedupe_key, kind, did, created_at) "
                         f"VALUES ('k{n}', 'commit', 'did:plc:r{n}', {n})")
    first, second = await store.pending_repairs()
    await store.mark_repair_consumed(first["id"], 9.5, 42, "applied")
    await store.mark_repair_consumed(second["id"], 10.5, None, "stale")
    assert await _rows(target, "SELECT did, consumed_at, seq, outcome FROM spark_repair_outbox ORDER BY id") == [
        ("did:plc:r1", 9.5, 42, "applied"), ("did:plc:r2", 10.5, None, "stale")]
    assert await store.pending_repairs() == []



async def test_first_pages_start_below_every_did_under_a_linguistic_collation(pg_dsn: str) -> None:
    """PostgreSQL orders text by the database's collation. Under a linguistic one (``en_US``, the
    default of many installs; here ICU's ``en``) ``did:…`` sorts before upper-case text, so a
    first page (no ``after_did``) must start below every string."""
    name = f"t_icu_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 ENCODING UTF8 '
                            "LOCALE_PROVIDER icu ICU_LOCALE 'en' LOCALE 'C.UTF-8'")
        store = await open_store(urlunsplit(urlsplit(pg_dsn)._replace(path=f"/{name}")))
        try:
            await store.migrate()
            await store.upsert_account(AccountState("did:plc:a", sync_state="desynchronized"))
            await store.upsert_account(AccountState("did:web:b.example"))
            assert [a.did for a in await store.list_accounts()] == ["did:plc:a", "did:web:b.example"]
            assert [a.did for a in await store.accounts_by_sync_state("desynchronized")] == ["did:plc:a"]
            lease = await store.acquire_writer(wait=True, timeout=10)
            try:
                hw = await lease.high_water()
                await lease.commit_batch(BatchWrite(hw, hw, collection_resets={"did:plc:a": {"app.bsky.feed.post": 1}}))
            finally:
                await lease.release()
            assert await store.list_repos_by_collection("app.bsky.feed.post") == ["did:plc:a"]
        finally:
            await store.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
