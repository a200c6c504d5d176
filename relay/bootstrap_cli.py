"""`relay bootstrap`: a worked example of an appview index, folded into SQLite from an export
and the live stream (``firehose.bootstrap``), exactly once.

    relay bootstrap --export ./exports/latest --relay http://127.0.0.1:2470 \\
        --db index.sqlite --collection app.bsky.feed.post --collection app.bsky.feed.like

Tables: ``records(did, collection, rkey, cid, record)`` (``record``: atproto JSON text),
``accounts(did, rev, active, status)``, ``meta(key, value)`` (``seq``: the stream position the
index stands at; ``phase``: ``snapshot`` until the snapshot is fully in, then ``live``). Every
stream event is applied in one transaction with the position it brings the index to, so a
restart (``relay bootstrap`` again with the same ``--db``) goes on from there, nothing applied
twice, nothing skipped; a bootstrap stopped during the snapshot starts over. The appview's view
is ``SELECT … FROM records JOIN accounts USING (did) WHERE active`` (``INDEX_VIEW``).
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
from collections.abc import Callable

from firehose.bootstrap import Batch, Bootstrap, BootstrapError

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (did TEXT NOT NULL, collection TEXT NOT NULL, rkey TEXT NOT NULL,
    cid TEXT NOT NULL, record TEXT NOT NULL, PRIMARY KEY (did, collection, rkey));
CREATE TABLE IF NOT EXISTS accounts (did TEXT PRIMARY KEY, rev TEXT, active INTEGER NOT NULL DEFAULT 1, status TEXT);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
#: the records an appview shows: those of accounts not known to be inactive
INDEX_VIEW = ("SELECT r.did, r.collection, r.rkey, r.cid FROM records r LEFT JOIN accounts a USING (did) "
              "WHERE coalesce(a.active, 1) = 1")
#: snapshot batches applied per transaction
SNAPSHOT_COMMIT_EVERY = 50


class SqliteIndex:
    """The fold: applies ``Batch``es to the SQLite file at ``path``."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._open = False
        self._pending = 0

    def close(self) -> None:
        if self._open:
            self.db.execute("COMMIT")
            self._open = False
        self.db.close()

    def meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def resume_point(self) -> tuple[int | None, dict[str, str]]:
        """(the position to go on from, each account's rev) — (None, {}) for a fresh start; an
        index left half-way through its snapshot is emptied (it starts over)."""
        if self.meta("phase") == "live":
            seq = self.meta("seq")
            revs = {str(d): str(r) for d, r in self.db.execute("SELECT did, rev FROM accounts WHERE rev IS NOT NULL")}
            return (int(seq) if seq is not None else None), revs
        self.db.executescript("DELETE FROM records; DELETE FROM accounts; DELETE FROM meta;")
        return None, {}

    def apply(self, batch: Batch) -> None:
        """Apply one batch; a stream batch is committed with its position at once, snapshot
        batches every ``SNAPSHOT_COMMIT_EVERY`` (the snapshot is redone whole after a stop)."""
        db = self.db
        if not self._open:
            db.execute("BEGIN")
            self._open = True
        puts = [(c.did, c.collection, c.rkey, c.cid, c.record) for c in batch.changes if c.kind == "put"]
        for c in batch.changes:
            if c.kind == "delete":
                db.execute("DELETE FROM records WHERE did = ? AND collection = ? AND rkey = ?",
                           (c.did, c.collection, c.rkey))
            elif c.kind == "reset":
                db.execute("DELETE FROM records WHERE did = ?", (c.did,))
            elif c.kind == "status":
                db.execute("INSERT INTO accounts (did, active, status) VALUES (?, ?, ?) ON CONFLICT (did) DO UPDATE "
                           "SET active = excluded.active, status = excluded.status", (c.did, int(c.active), c.status))
            elif c.kind == "put" and len(puts) < 2:
                db.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)", puts[0])
        if len(puts) >= 2:
            db.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)", puts)
        if batch.did is not None and batch.rev is not None:
            db.execute("INSERT INTO accounts (did, rev) VALUES (?, ?) ON CONFLICT (did) DO UPDATE SET rev = excluded.rev",
                       (batch.did, batch.rev))
        if batch.live:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('phase', 'live')")
        self._pending += 1
        if batch.seq is not None:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('seq', ?)", (str(batch.seq),))
        if batch.seq is not None or self._pending >= SNAPSHOT_COMMIT_EVERY:
            db.execute("COMMIT")
            self._open = False
            self._pending = 0

    def index(self) -> set[tuple[str, str, str, str]]:
        """The appview's records: (did, collection, rkey, cid)."""
        return {(str(a), str(b), str(c), str(d)) for a, b, c, d in self.db.execute(INDEX_VIEW)}


async def run_bootstrap(export: str, relay: str, db_path: str, collections: list[str] | None = None, *,
                        stop: Callable[[SqliteIndex, Batch], bool] = lambda _i, _b: False,
                        stats: dict[str, int] | None = None) -> SqliteIndex:
    """Fold the export and the stream into ``db_path`` until ``stop(index, batch)`` is true after
    a batch (never, by default); returns the (closed) index. ``stats`` receives
    ``Bootstrap.stats`` after every batch."""
    index = SqliteIndex(db_path)
    try:
        seq, revs = index.resume_point()
        boot = Bootstrap(export, relay, collections, resume=seq, account_revs=revs)
        async for batch in boot:
            index.apply(batch)
            if stats is not None:
                stats.update(boot.stats)
            if stop(index, batch):
                break
    finally:
        index.close()
    return index


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="relay bootstrap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="the export: a directory, a pyarrow URI or an http(s) URL")
    parser.add_argument("--relay", required=True, help="the relay's base URL (http://host:port)")
    parser.add_argument("--db", default="index.sqlite", help="the SQLite index (created; resumed when it exists)")
    parser.add_argument("--collection", action="append", help="a collection to index (repeat; default: all)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(run_bootstrap(args.export, args.relay, args.db, args.collection))
    except BootstrapError as exc:
        print(f"relay bootstrap: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
