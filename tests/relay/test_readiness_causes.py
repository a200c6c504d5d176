"""Readiness names the cause: a relay started on a store it cannot write to is not ready until a
write has succeeded (``store_not_writable: read_only …``), and a full disk while it runs reads
``sequencer_retrying: disk_full …``. Both are real SQLite refusing real writes: the write check
run with ``query_only`` set (SQLITE_READONLY), or the database held at its current size with
``max_page_count`` (SQLITE_FULL, what a full disk returns).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx

from backfill.backends import open_store
from backfill.sqlite_store import SqliteStore
from backfill.store import Store
from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl
from tests.waiting import until, until_async


async def _on_writer(store: Store, sql: str) -> Any:
    """Run one statement on the SQLite store's writer connection (its own thread)."""
    assert isinstance(store, SqliteStore)
    return await store._writer.call(lambda conn: conn.execute(sql).fetchone())  # noqa: SLF001


class ReadOnlyChecks:
    """Makes the relay's write check (``RelayService._prove_writable``) meet a read-only database:
    while ``on``, its upsert runs on the writer connection with ``query_only`` set, in one call on
    that connection's thread (SQLite itself refuses it; nothing else is affected)."""

    def __init__(self, store: Store) -> None:
        assert isinstance(store, SqliteStore)
        self.on = True
        self.refused = 0
        real = store.set_setting

        def refused_upsert(conn: sqlite3.Connection, key: str, value: str) -> None:
            conn.execute("PRAGMA query_only = 1")
            try:
                conn.execute("INSERT INTO relay_settings (key, value) VALUES (?, ?) "
                             "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))
            finally:
                conn.execute("PRAGMA query_only = 0")

        async def set_setting(key: str, value: str) -> None:
            if self.on and key == "last_write_check":
                self.refused += 1
                await store._writer.call(refused_upsert, key, value)  # noqa: SLF001
            await real(key, value)

        store.set_setting = set_setting  # type: ignore[method-assign]


async def test_a_relay_started_on_a_store_it_cannot_write_is_not_ready(relay_factory: Any, tmp_path: Path) -> None:
    store = await open_store(str(tmp_path / "relay.sqlite"))
    checks = ReadOnlyChecks(store)
    async with relay_factory(store=store) as relay, httpx.AsyncClient(base_url=relay.url) as http:
        service = relay.service
        await until(lambda: checks.refused >= 1 and service._write_error is not None,  # noqa: SLF001
                    "the write check to be refused")
        ready = await http.get("/_ready")
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["sequencer"] == "running"  # nothing to sequence: only the write check can tell
        assert any(r.startswith("store_not_writable: read_only (OperationalError: attempt to write a readonly")
                   for r in body["reasons"]), body
        assert (await http.get("/_health")).status_code == 200
        checks.on = False

        async def ready_again() -> bool:
            return (await http.get("/_ready")).status_code == 200

        await until_async(ready_again, "readiness once a write succeeds", timeout=30)
        assert service.store_written.is_set()


async def test_a_full_disk_is_named_in_readiness(relay_factory: Any, tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=28))
    await fleet.start()
    store = await open_store(str(tmp_path / "relay.sqlite"))
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(store=store, **settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer, \
                httpx.AsyncClient(base_url=relay.url) as http:
            sequencer = relay.service.sequencer
            assert sequencer is not None
            await crawl(relay.url, fleet.hosts[0].hostname)
            warm = await fleet.generate(2)
            await consumer.wait_for(lambda evs: {t.rev for t in warm} <= {e.rev for e in evs})
            assert (await http.get("/_ready")).status_code == 200
            pages = (await _on_writer(store, "PRAGMA page_count"))[0]
            await _on_writer(store, f"PRAGMA max_page_count = {pages}")
            truth = await fleet.generate(40)
            await until(lambda: sequencer.state == "retrying", "the sequencer to hold its batch on the full disk")
            ready = await http.get("/_ready")
            assert ready.status_code == 503, ready.text
            assert any(r.startswith("sequencer_retrying: disk_full (OperationalError: database or disk is full")
                       for r in ready.json()["reasons"]), ready.text
            await _on_writer(store, "PRAGMA max_page_count = 1073741823")
            revs = {t.rev for t in truth}
            await consumer.wait_for(lambda evs: revs <= {e.rev for e in evs})  # 0 lost
            check_stream(consumer.events)
            assert (await http.get("/_ready")).status_code == 200
    finally:
        await fleet.stop()


def test_store_errors_are_classified() -> None:
    """The causes readiness reports, from the errors each backend really raises."""
    import asyncpg

    from backfill.errors import SequencerConflictError
    from backfill.failure import classify_store_error

    full = sqlite3.connect(":memory:")
    full.execute("CREATE TABLE t (a)")
    full.execute("PRAGMA max_page_count = 1")  # smaller than the database: every growth fails
    try:
        for _ in range(100):
            full.execute("INSERT INTO t VALUES (zeroblob(8000))")
    except sqlite3.OperationalError as exc:
        assert classify_store_error(exc) == "disk_full"
    else:
        raise AssertionError("the insert did not fail")
    assert classify_store_error(asyncpg.exceptions.DiskFullError("no space")) == "disk_full"
    assert classify_store_error(asyncpg.exceptions.ReadOnlySQLTransactionError("ro")) == "read_only"
    assert classify_store_error(asyncpg.exceptions.CannotConnectNowError("starting")) == "store_unreachable"
    assert classify_store_error(ConnectionRefusedError(111, "refused")) == "store_unreachable"
    assert classify_store_error(TimeoutError()) == "store_timeout"
    assert classify_store_error(SequencerConflictError("moved")) == "writer_lease_lost"
    assert classify_store_error(sqlite3.OperationalError("database is locked")) == "store_locked"
