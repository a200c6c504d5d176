"""What only the SQLite backend has: which of SQLite's errors mean "unavailable right now", the
parameter chunking of its ``IN`` lookups and its single-writer lease file."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from pathlib import Path

import pytest

from backfill.errors import SequencerLockedError
from backfill.sqlite_store import SqliteStore
from backfill.store import BatchWrite, writer_identity
from firehose.state import AccountState


def _error_of(action: str, tmp_path: Path) -> sqlite3.OperationalError:
    """A real error from SQLite, made by doing what causes it."""
    db = str(tmp_path / "errors.sqlite")
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("CREATE TABLE IF NOT EXISTS t (x BLOB)")
        other = sqlite3.connect(db, isolation_level=None, timeout=0)
        try:
            if action == "locked":  # another connection holds the write lock; no waiting
                holder.execute("BEGIN EXCLUSIVE")
                try:
                    other.execute("INSERT INTO t VALUES (1)")
                finally:
                    holder.execute("ROLLBACK")
            elif action == "full":  # the database may not grow (as on a full disk)
                other.execute("PRAGMA max_page_count = 2")
                other.execute("INSERT INTO t VALUES (zeroblob(100000))")
            elif action == "unopenable":
                sqlite3.connect(str(tmp_path / "no" / "such" / "dir.sqlite")).execute("SELECT 1")
            elif action == "no table":
                other.execute("SELECT * FROM missing")
        finally:
            other.close()
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        holder.close()
    raise AssertionError(f"{action}: no error")


@pytest.mark.parametrize("action", ["locked", "full", "unopenable"])
async def test_sqlite_errors_of_an_unavailable_database_are_transient(action: str, tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "relay.sqlite"))
    try:
        assert store.is_transient(_error_of(action, tmp_path))
    finally:
        await store.close()


async def test_transient_sqlite_errors_are_told_by_their_text(tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "relay.sqlite"))
    try:
        # texts SQLite gives for conditions a test cannot cause at will (an I/O error, a busy
        # database), in SQLite's own capitals
        assert store.is_transient(sqlite3.OperationalError("disk I/O error"))
        assert store.is_transient(sqlite3.OperationalError("Database Busy"))
        assert store.is_transient(OSError("connection lost"))  # the base class's kinds still count
        # a wrong statement or a broken constraint is not "unavailable"
        assert not store.is_transient(_error_of("no table", tmp_path))
        assert not store.is_transient(sqlite3.IntegrityError("database is locked"))
        assert not store.is_transient(ValueError("full"))
    finally:
        await store.close()


async def test_the_lease_file_names_its_holder_while_it_is_held(tmp_path: Path) -> None:
    path = str(tmp_path / "relay.sqlite")
    holder, waiter = await SqliteStore.open(path), await SqliteStore.open(path)
    try:
        assert await waiter.writer_holder() is None  # no lease file yet
        lease = await holder.acquire_writer()
        lock_file = Path(path + ".writer.lock")
        try:
            # readable by everyone, so a standby running as another user can name the holder
            umask = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                             if line.startswith("Umask:")), 8)
            assert stat.S_IMODE(lock_file.stat().st_mode) == 0o644 & ~umask
            # taken: refused at once by default, after the timeout when waiting
            with pytest.raises(SequencerLockedError, match="another sequencer holds the write lock on "):
                await asyncio.wait_for(waiter.acquire_writer(), 30)
            with pytest.raises(SequencerLockedError):
                await asyncio.wait_for(waiter.acquire_writer(wait=True, timeout=0.3), 30)
            assert await waiter.writer_holder() == writer_identity()
            assert await holder.writer_holder() == writer_identity()  # asked through another descriptor
            # what the holder wrote, as text: trimmed, at most 512 bytes, undecodable bytes replaced
            for written, named in ((b"  pod-7 pid 12\n", "pod-7 pid 12"), (b"", "unnamed process"),
                                   (b" \n", "unnamed process"), (b"x" * 600, "x" * 512),
                                   (b"pod-\xff", "pod-\ufffd")):
                lock_file.write_bytes(written)
                assert await waiter.writer_holder() == named
        finally:
            await lease.release()
        assert await waiter.writer_holder() is None  # the file stays, the lock is free
        # asking left the lock free: the waiter takes the lease at once
        again = await waiter.acquire_writer()
        try:
            assert await holder.writer_holder() == writer_identity()
        finally:
            await again.release()
    finally:
        await holder.close()
        await waiter.close()


async def test_lookups_of_many_keys_find_every_stored_one(tmp_path: Path) -> None:
    """``IN`` lookups go in chunks of bound parameters: every key of every chunk is looked up."""
    store = await SqliteStore.open(str(tmp_path / "relay.sqlite"))
    try:
        await store.migrate()
        dids = [f"did:plc:{i:05d}" for i in range(1200)]
        lease = await store.acquire_writer()
        try:
            await lease.commit_batch(BatchWrite(0, 0, accounts=[
                AccountState(did=d, host="pds.example", rev=f"rev{i}") for i, d in enumerate(dids)]))
        finally:
            await lease.release()
        asked = dids + [f"did:plc:missing{i}" for i in range(300)]
        assert sorted(await store.get_accounts(asked)) == dids
        assert await store.account_heads(asked) == {d: ("pds.example", f"rev{i}") for i, d in enumerate(dids)}
    finally:
        await store.close()


async def test_a_store_opens_in_a_new_directory_and_closes_its_connections(tmp_path: Path) -> None:
    path = tmp_path / "new" / "dirs" / "relay.sqlite"
    store = await SqliteStore.open(str(path))
    await store.migrate()
    wal = Path(f"{path}-wal")
    assert wal.exists()  # WAL mode: the log lives while connections are open
    await store.close()
    assert not wal.exists()  # the last connection closed checkpoints and removes it
    await store.close()  # idempotent
