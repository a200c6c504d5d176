"""Accounts, hosts, domain bans and operator state on both backends (the ``store`` fixture is parametrized)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3

import asyncpg
import pytest

from backfill.backends import open_store
from backfill.errors import SequencerLockedError
from backfill.postgres_store import PostgresStore, _PgLease
from backfill.store import (
    BatchWrite,
    Store,
    audit_entry,
    host_count_deltas,
    is_postgres_url,
    split_schema,
    sqlite_path_from_url,
    writer_identity,
)
from backfill.types import HostState
from firehose.state import AccountState
from tests.backfill.conftest import StoreTarget
from tests.waiting import until_async


def acct(did: str, host: str | None = "pds.example", **kw: object) -> AccountState:
    return AccountState(did=did, host=host, **kw)  # type: ignore[arg-type]


async def test_account_roundtrip_and_replace(store: Store) -> None:
    assert await store.get_account("did:plc:a") is None
    state = acct("did:plc:a", rev="3kaaaaaaaaaa2", commit_cid="bafyc", data_cid="bafyd", updated_at=12.5)
    await store.upsert_account(state)
    assert await store.get_account("did:plc:a") == state
    state2 = acct(
        "did:plc:a", upstream_status="deactivated", local_status="takendown", sync_state="desynchronized"
    )
    await store.upsert_account(state2)  # no rev: the stored head (rev, commit, data) stays
    got = await store.get_account("did:plc:a")
    assert got is not None
    assert (got.upstream_status, got.local_status, got.sync_state, got.rev, got.commit_cid, got.data_cid) == (
        "deactivated",
        "takendown",
        "desynchronized",
        "3kaaaaaaaaaa2",
        "bafyc",
        "bafyd",
    )
    assert got.updated_at > 0  # filled in when the caller left it at 0
    await store.upsert_account(acct("did:plc:a", rev="3kaaaaaaaaab2", commit_cid="bafyc2"))  # a rev: all replaced
    got = await store.get_account("did:plc:a")
    assert got is not None and (got.rev, got.commit_cid, got.data_cid) == ("3kaaaaaaaaab2", "bafyc2", None)


async def test_get_accounts_many(store: Store) -> None:
    for i in range(700):  # more than one SQLite parameter chunk
        await store.upsert_account(acct(f"did:plc:{i:04d}"))
    got = await store.get_accounts([f"did:plc:{i:04d}" for i in range(0, 1400, 2)])
    assert sorted(got) == [f"did:plc:{i:04d}" for i in range(0, 700, 2)]
    assert await store.get_accounts([]) == {}


async def test_list_accounts_pages_in_did_order(store: Store) -> None:
    dids = [f"did:plc:{c}" for c in "qwertyuiopasdfgh"]
    for did in dids:
        await store.upsert_account(acct(did))
    seen: list[str] = []
    cursor = None
    for _ in range(20):
        page = await store.list_accounts(cursor, limit=5)
        if not page:
            break
        seen += [a.did for a in page]
        cursor = page[-1].did
    assert seen == sorted(dids)


async def test_accounts_by_sync_state_and_counts(store: Store) -> None:
    await store.upsert_account(acct("did:plc:1", host="a.example", sync_state="desynchronized"))
    await store.upsert_account(acct("did:plc:2", host="a.example"))
    await store.upsert_account(acct("did:plc:3", host="b.example", sync_state="desynchronized"))
    desync = await store.accounts_by_sync_state("desynchronized")
    assert [a.did for a in desync] == ["did:plc:1", "did:plc:3"]
    assert [a.did for a in await store.accounts_by_sync_state("desynchronized", limit=1)] == ["did:plc:1"]
    after = await store.accounts_by_sync_state("desynchronized", after_did="did:plc:1")
    assert [a.did for a in after] == ["did:plc:3"]
    assert [a.did for a in await store.accounts_by_sync_state("synced")] == ["did:plc:2"]
    assert await store.count_accounts() == 3
    assert await store.count_accounts("a.example") == 2
    assert await store.count_accounts("nowhere.example") == 0


async def test_host_account_count_follows_upserts(store: Store) -> None:
    await store.upsert_account(acct("did:plc:1", host="a.example"))
    await store.upsert_account(acct("did:plc:2", host="a.example"))
    await store.upsert_account(acct("did:plc:2", host="a.example"))  # same host: no change
    await store.upsert_account(acct("did:plc:1", host="b.example"))  # moved
    a, b = await store.get_host("a.example"), await store.get_host("b.example")
    assert a is not None and b is not None
    assert (a.account_count, b.account_count) == (1, 1)


async def test_hosts_crud_and_cursor(store: Store) -> None:
    host = HostState(
        "pds.example",
        account_limit=100,
        trusted=True,
        rate_limit_per_second=50,
        rate_limit_per_hour=1000,
        rate_limit_per_day=9000,
        cursor=7,
    )
    await store.upsert_host(host)
    got = await store.get_host("pds.example")
    assert got is not None
    assert (got.status, got.cursor, got.account_limit, got.trusted, got.rate_limit_per_second) == (
        "active",
        7,
        100,
        True,
        50,
    )
    assert (got.rate_limit_per_hour, got.rate_limit_per_day) == (1000, 9000)
    assert got.created_at > 0
    # Reconfiguring keeps the cursor (owned by the sequencer).
    await store.upsert_host(HostState("pds.example", trusted=False, account_limit=5, cursor=0))
    got = await store.get_host("pds.example")
    assert got is not None and (got.cursor, got.trusted, got.account_limit) == (7, False, 5)
    assert await store.host_cursor("pds.example") == 7
    assert await store.set_host_cursor("pds.example", 3)
    assert await store.host_cursor("pds.example") == 3
    assert await store.host_cursor("unknown.example") is None
    assert not await store.set_host_cursor("unknown.example", 1)
    assert await store.set_host_status("pds.example", "banned")
    assert not await store.set_host_status("unknown.example", "banned")
    got = await store.get_host("pds.example")
    assert got is not None and got.status == "banned"


async def test_host_kind_and_lenient_setting_round_trip(store: Store) -> None:
    """Migration 0085: a host may be a relay, and carries its lenient setting (None = the relay's)."""
    await store.upsert_host(HostState("pds.example"))
    await store.upsert_host(HostState("relay.example", relay=True, lenient=False))
    got = {h.hostname: (h.relay, h.lenient) for h in await store.list_hosts()}
    assert got == {"pds.example": (False, None), "relay.example": (True, False)}
    await store.upsert_host(HostState("pds.example", lenient=True))
    await store.upsert_host(HostState("relay.example", relay=True, lenient=None))
    got = {h.hostname: (h.relay, h.lenient) for h in await store.list_hosts()}
    assert got == {"pds.example": (False, True), "relay.example": (True, None)}


async def test_list_hosts_paging(store: Store) -> None:
    names = [f"h{i:02d}.example" for i in range(7)]
    for name in reversed(names):
        await store.upsert_host(HostState(name))
    first = await store.list_hosts(limit=4)
    rest = await store.list_hosts(after=first[-1].hostname, limit=4)
    assert [h.hostname for h in first + rest] == names


async def test_operator_state_round_trips(store: Store) -> None:
    assert await store.get_setting("crawling_enabled") is None
    await store.set_setting("crawling_enabled", "false")
    await store.set_setting("crawling_enabled", "true")  # replaces
    assert await store.get_setting("crawling_enabled") == "true"
    assert await store.count_crawl_admissions(0) == 0
    for hostname, at in (("a.example", 100.0), ("b.example", 200.0), ("c.example", 300.0)):
        await store.record_crawl_admission(hostname, at)
    assert await store.count_crawl_admissions(200.0) == 2  # inclusive lower bound
    assert await store.count_crawl_admissions(300.5) == 0
    for n in range(5):
        await store.record_admin_action(1000.0 + n, "block_host", f"h{n}.example", json.dumps({"n": n}))
    await store.record_admin_action(2000.0, "odd", "x", "not json")
    recent = await store.list_admin_actions(3)
    assert [a["target"] for a in recent] == ["h3.example", "h4.example", "x"]  # newest three, oldest first
    assert recent[0] == {"time": 1003.0, "action": "block_host", "target": "h3.example", "detail": {"n": 3}}
    assert recent[2]["detail"] == "not json"


async def test_domain_bans(store: Store) -> None:
    assert await store.list_domain_bans() == []
    assert await store.add_domain_ban("Evil.Example")
    assert not await store.add_domain_ban("evil.example")
    assert await store.add_domain_ban("bad.example")
    assert await store.list_domain_bans() == ["bad.example", "evil.example"]
    assert await store.remove_domain_ban("EVIL.example")
    assert not await store.remove_domain_ban("evil.example")
    assert await store.list_domain_bans() == ["bad.example"]


async def test_empty_window(store: Store) -> None:
    assert await store.latest_seq() == 0
    assert await store.oldest_seq() is None
    assert await store.read_after(0) == []
    assert await store.events_bytes() == 0


def test_sqlite_url_forms() -> None:
    assert sqlite_path_from_url(None) == "./data/relay.sqlite"
    assert sqlite_path_from_url("") == "./data/relay.sqlite"
    assert sqlite_path_from_url("sqlite:///tmp/x.db") == "/tmp/x.db"
    assert sqlite_path_from_url("sqlite://rel/x.db") == "rel/x.db"
    assert sqlite_path_from_url("sqlite:rel/x.db") == "rel/x.db"
    assert sqlite_path_from_url("/abs/x.db") == "/abs/x.db"
    assert sqlite_path_from_url("rel/sqlite:x.db") == "rel/sqlite:x.db"


def test_which_urls_are_postgres_and_their_schema() -> None:
    for url in ("postgresql://u@h/db", "postgres://u@h:5432/db?schema=s"):
        assert is_postgres_url(url)
    for url in (None, "", "sqlite:///tmp/x.db", "/abs/x.db", "postgresqlx://h/db", "mysql://h/postgres:x"):
        assert not is_postgres_url(url)
    assert split_schema("postgresql://u@h:5432/db?schema=s1&sslmode=disable") == (
        "postgresql://u@h:5432/db?sslmode=disable", "s1")
    assert split_schema("postgresql://u@h/db?a=&schema=&b=2") == ("postgresql://u@h/db?a=&b=2", None)
    assert split_schema("postgresql://u@h/db") == ("postgresql://u@h/db", None)


def test_host_count_deltas() -> None:
    """An account's move between hosts: -1 on the host it left (if it existed there), +1 on its new one."""
    assert host_count_deltas(True, "a", "a") == {}
    assert host_count_deltas(True, "a", "b") == {"a": -1, "b": 1}
    assert host_count_deltas(True, "a", None) == {"a": -1}
    assert host_count_deltas(True, None, "b") == {"b": 1}
    assert host_count_deltas(True, None, None) == {}
    assert host_count_deltas(False, None, "b") == {"b": 1}
    assert host_count_deltas(False, "a", "a") == {"a": 1}  # new: the old host is not read
    assert host_count_deltas(False, "a", None) == {}


def test_helpers_of_the_store_core() -> None:
    """A batch's frame bytes; an audit row as the API shows it; the writer's name."""
    assert BatchWrite(0, 0).frame_bytes == 0
    assert BatchWrite(0, 2, events=[(1, "d", "#commit", 1.0, b"abc"), (2, "d", "#sync", 1.0, b"de")]).frame_bytes == 5
    assert audit_entry(1.5, "ban", "x.example", '{"by": "op"}') == {
        "time": 1.5, "action": "ban", "target": "x.example", "detail": {"by": "op"}}
    assert audit_entry(2.0, "note", "t", "not json") == {"time": 2.0, "action": "note", "target": "t",
                                                         "detail": "not json"}
    assert writer_identity() == f"{socket.gethostname()} pid {os.getpid()}"


async def test_a_store_closes_at_the_end_of_its_block_and_classifies_failures(target: StoreTarget) -> None:
    """``async with`` gives the store itself and closes it; an unreachable database (``OSError``,
    ``TimeoutError``, ``ConnectionError``) is transient, a wrong write is not."""
    opened = await target.open()
    async with opened as store:
        assert store is opened
        assert await store.migrate() != []
    assert opened._closed  # type: ignore[attr-defined]
    for exc in (OSError("refused"), TimeoutError(), ConnectionResetError()):
        assert opened.is_transient(exc)
    for wrong in (ValueError("bad"), KeyError("k"), sqlite3.IntegrityError("unique")):
        assert not opened.is_transient(wrong)


async def test_batch_host_cursor_never_moves_backwards(store: Store) -> None:
    """A batch's host cursor only raises the stored one (``MAX``/``GREATEST``): a cursor from an
    older connection's late batch must not rewind the host, or a restart would re-read (and, for
    a cursor past a lost event, skip) frames. Only the operator's ``set_host_cursor`` rewinds."""
    from backfill.store import BatchWrite

    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        hw = await lease.high_water()

        async def batch(cursor: int | None) -> int | None:
            await lease.commit_batch(BatchWrite(hw, hw, host_updates={"pds.example": (cursor, None, 0)}))
            return await store.host_cursor("pds.example")

        assert await batch(10) == 10
        assert await batch(5) == 10
        assert await batch(None) == 10
        assert await batch(12) == 12
    finally:
        await lease.release()
    assert await store.set_host_cursor("pds.example", 3)
    assert await store.host_cursor("pds.example") == 3


async def test_upstream_done_rows_above_the_cursor(store: Store) -> None:
    """Frames stored above their host's watermark (``BatchWrite.upstream_done``) are written with
    the batch; ``upstream_done_above`` returns those above the cursor asked for and deletes the
    rest; resetting the host's cursor forgets them all (its stream restarted)."""
    from backfill.store import BatchWrite

    lease = await store.acquire_writer(wait=True, timeout=10)
    try:
        hw = await lease.high_water()
        await lease.commit_batch(BatchWrite(hw, hw, host_updates={"pds.example": (4, None, 0)},
                                            upstream_done=[("pds.example", 7), ("pds.example", 9), ("other.example", 8)]))
        await lease.commit_batch(BatchWrite(hw, hw, upstream_done=[("pds.example", 9), ("pds.example", 12)]))
    finally:
        await lease.release()
    assert await store.upstream_done_above("pds.example", 4) == [7, 9, 12]
    assert await store.upstream_done_above("pds.example", 9) == [12]
    assert await store.upstream_done_above("pds.example", 4) == [12]  # 7 and 9 were deleted
    assert await store.upstream_done_above("other.example", 0) == [8]
    assert await store.set_host_cursor("pds.example", 0)
    assert await store.upstream_done_above("pds.example", 0) == []
    assert await store.upstream_done_above("other.example", 0) == [8]


async def test_account_heads_and_throttled_counts_per_host(store: Store) -> None:
    """The lighter reads of the store core: heads for many DIDs (duplicates and more than one SQLite
    parameter chunk), and accounts in one sync state per host."""
    for i in range(600):
        host = "a.example" if i % 3 else "b.example"
        await store.upsert_account(acct(f"did:plc:{i:04d}", host=host, rev=f"rev{i}",
                                        sync_state="throttled" if i % 2 else "synced"))
    await store.upsert_account(acct("did:plc:nohost", host=None, sync_state="throttled"))
    wanted = [f"did:plc:{i:04d}" for i in range(0, 1200, 2)] + ["did:plc:0002", "did:plc:nohost"]
    heads = await store.account_heads(wanted)
    assert heads == {**{f"did:plc:{i:04d}": ("a.example" if i % 3 else "b.example", f"rev{i}") for i in range(0, 600, 2)},
                     "did:plc:nohost": (None, None)}
    assert await store.account_heads([]) == {}
    odd = range(1, 600, 2)
    assert await store.count_accounts_by_host("throttled") == {
        "a.example": sum(1 for i in odd if i % 3), "b.example": sum(1 for i in odd if not i % 3)}
    assert await store.count_accounts_by_host("desynchronized") == {}


async def test_pending_repairs_come_as_named_columns_in_queue_order(store: Store, target: StoreTarget) -> None:
    blob = "decode('00ff', 'hex')" if target.backend == "postgres" else "x'00ff'"
    for n in (1, 2, 3):
        await target.sql(
            "INSERT INTO spark_repair_outbox (dedupe_key, kind, did, host, rev, blocks, active, status, run_id, "
            f"created_at, base_rev, collections) VALUES ('k{n}', 'commit', 'did:plc:r{n}', 'h.example', 'rev{n}', "
            f"{blob}, {'true' if target.backend == 'postgres' else 1}, 'active', 'run', {n}.5, 'base{n}', "
            "'{\"app.bsky.feed.post\": 2}')")
    rows = await store.pending_repairs(limit=2)
    assert [r["did"] for r in rows] == ["did:plc:r1", "did:plc:r2"]
    first = rows[0]
    assert set(first) == {"id", "kind", "did", "host", "rev", "commit_cid", "data_cid", "blocks", "active", "status",
                          "base_rev", "base_commit_cid", "base_status", "observed_at", "created_at", "run_id",
                          "collections"}
    assert (first["kind"], first["host"], first["rev"], bytes(first["blocks"]), bool(first["active"]),
            first["base_rev"], first["created_at"], first["commit_cid"]) == (
        "commit", "h.example", "rev1", b"\x00\xff", True, "base1", 1.5, None)
    await store.mark_repair_consumed(first["id"], 9.0, 42, "applied")
    later = await store.pending_repairs(after_id=0)
    assert [r["did"] for r in later] == ["did:plc:r2", "did:plc:r3"]
    assert [r["did"] for r in await store.pending_repairs(after_id=later[0]["id"])] == ["did:plc:r3"]


def locked_message(schema: str | None) -> str:
    return (f"another sequencer holds the write lock on schema {schema!r}: only one relay ingest process "
            "may write to a database; stop the other one or point this one elsewhere")


async def test_postgres_writer_holder_names_the_backend_holding_the_lease(pg_target: StoreTarget) -> None:
    """A standby shows who holds the writer lease (``waitingFor``): the holder's
    ``writer_identity()``, its backend pid and its client address (none over a Unix socket), or
    "unnamed client" for a connection without an application name; None while nobody holds it."""
    store = await pg_target.open()
    await store.migrate()
    standby = await pg_target.open()
    try:
        assert await standby.writer_holder() is None
        lease = await store.acquire_writer()
        assert isinstance(lease, _PgLease)
        try:
            pid = lease._conn.get_server_pid()
            addr = await lease._conn.fetchval("SELECT host(inet_client_addr())")
            name = f"relay-writer {writer_identity()}"[:63].removeprefix("relay-writer ")
            assert await standby.writer_holder() == f"{name} (PostgreSQL backend {pid}, from {addr})"
            with pytest.raises(SequencerLockedError) as refused:
                await standby.acquire_writer()
            assert str(refused.value) == locked_message(pg_target.schema)
        finally:
            await lease.release()

        # a client of the same database over the server's Unix socket, without an application name
        probe = await asyncpg.connect(pg_target.url)
        try:
            socket_dir = (await probe.fetchval("SHOW unix_socket_directories")).split(",")[0].strip()
            port, user, database = await probe.fetchrow(
                "SELECT current_setting('port')::int, current_user, current_database()")
        finally:
            await probe.close()
        other = await asyncpg.connect(host=socket_dir, port=port, user=user, database=database,
                                      server_settings={"application_name": ""})
        try:
            await other.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))",
                                f"relay.sequencer/{pg_target.schema}")
            assert await standby.writer_holder() == f"unnamed client (PostgreSQL backend {other.get_server_pid()})"
        finally:
            await other.close()
    finally:
        await standby.close()
        await store.close()


async def test_postgres_connect_checks_the_schema_and_sets_up_each_connection(pg_target: StoreTarget) -> None:
    """A schema name that is not a plain lower-case identifier is refused before connecting; the
    pool has the size asked for, and each of its connections (and the dedicated ones) is named
    ``relay`` and looks in the store's schema first, or in the server's default path without one."""
    for bad in ("Upper", "has-dash", "1digit", "x" * 64, 'q"uote'):
        with pytest.raises(ValueError) as refused:
            await open_store(pg_target.url, schema=bad)
        assert str(refused.value) == f"invalid schema name: {bad!r}"
    store = await open_store(pg_target.url, schema=pg_target.schema, pool_size=3)
    default = await open_store(pg_target.url, pool_size=2)
    try:
        assert isinstance(store, PostgresStore) and isinstance(default, PostgresStore)
        assert (store._pool.get_max_size(), default._pool.get_max_size()) == (3, 2)
        setting = "SELECT current_setting('application_name'), current_setting('search_path')"
        assert tuple(await store._pool.fetchrow(setting)) == ("relay", pg_target.schema)
        server_default = await default._pool.fetchval("SELECT reset_val FROM pg_settings WHERE name = 'search_path'")
        assert tuple(await default._pool.fetchrow(setting)) == ("relay", server_default)
        dedicated = await store._connect_dedicated()
        try:
            assert tuple(await dedicated.fetchrow(setting)) == ("relay", pg_target.schema)
        finally:
            await dedicated.close()
    finally:
        await default.close()
        await store.close()


async def test_postgres_a_store_without_a_schema_shares_the_lease_of_the_public_schema(pg_dsn: str) -> None:
    """Without a schema a store writes the server's default (``public``) tables, so it takes the
    same writer lease as a store opened on ``public`` by name: only one of them may write, and the
    refusal names the schema."""
    default = await open_store(pg_dsn)
    public = await open_store(pg_dsn, schema="public")
    try:
        lease = await public.acquire_writer()
        try:
            with pytest.raises(SequencerLockedError) as refused:
                await default.acquire_writer()
            assert str(refused.value) == locked_message("public")
        finally:
            await lease.release()
    finally:
        await public.close()
        await default.close()


async def test_postgres_close_gives_the_connections_back(pg_target: StoreTarget) -> None:
    """``close`` ends the pool's connections (the server sees them go); a closed store refuses
    queries, and closing it again is harmless."""
    store = await pg_target.open()
    await store.migrate()
    assert isinstance(store, PostgresStore)
    pid = await store._pool.fetchval("SELECT pg_backend_pid()")
    await store.close()
    with pytest.raises(asyncpg.InterfaceError):
        await store.latest_seq()
    await store.close()
    probe = await asyncpg.connect(pg_target.url)
    try:
        async def gone() -> bool:
            return not await probe.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)

        await until_async(gone, "the closed pool's backend to end")
    finally:
        await probe.close()
