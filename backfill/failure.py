"""What a store error means, in one word, for readiness and logs.

``classify_store_error(exc)`` maps the errors the stores raise (``sqlite3``, ``asyncpg``, the
sequencer's own) to a cause an operator can act on:

* ``disk_full`` — SQLite ``SQLITE_FULL`` ("database or disk is full"), Postgres class 53
  (``DiskFullError``, out of memory or connections is ``store_overloaded``);
* ``read_only`` — SQLite ``SQLITE_READONLY``, Postgres ``read_only_sql_transaction`` (a replica, a
  read-only transaction default) or a permission refusal;
* ``store_locked`` — SQLite busy/locked (another process holds the write lock);
* ``store_io_error`` — SQLite I/O error or a file it cannot open (lost mount, bad permissions);
* ``store_unreachable`` — connection refused or lost, server shutting down or starting;
* ``store_timeout`` — an operation did not answer in time;
* ``writer_lease_lost`` — another writer took the lease or moved the high-water mark;
* ``store_error`` — anything else.
"""

from __future__ import annotations

import sqlite3

import asyncpg

from backfill.errors import SequencerConflictError, SequencerLockedError


def classify_store_error(exc: BaseException) -> str:
    """See the module docstring."""
    if isinstance(exc, (SequencerLockedError, SequencerConflictError)):
        return "writer_lease_lost"
    if isinstance(exc, sqlite3.Error):
        return _classify_sqlite(exc)
    if isinstance(exc, asyncpg.PostgresError):
        return _classify_postgres(exc)
    if isinstance(exc, TimeoutError):
        return "store_timeout"
    if isinstance(exc, (OSError, asyncpg.InterfaceError)):
        return "store_unreachable"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        return classify_store_error(cause)
    return "store_error"


def describe_store_error(exc: BaseException) -> str:
    """``cause (Type: message)``, short enough for a readiness reason."""
    return f"{classify_store_error(exc)} ({type(exc).__name__}: {str(exc)[:160]})"


def _classify_sqlite(exc: sqlite3.Error) -> str:
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc).lower()
    if name.startswith("SQLITE_FULL") or "disk is full" in text:
        return "disk_full"
    if name.startswith(("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")) or "readonly" in text:
        return "read_only"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text or "busy" in text:
        return "store_locked"
    if name.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")) or "disk i/o" in text or "unable to open" in text:
        return "store_io_error"
    return "store_error"


def _classify_postgres(exc: asyncpg.PostgresError) -> str:
    state = str(getattr(exc, "sqlstate", "") or "")
    if state == "53100":  # disk_full
        return "disk_full"
    if state.startswith("53"):  # insufficient resources: memory, connections
        return "store_overloaded"
    if state in ("25006", "42501"):  # read_only_sql_transaction, insufficient_privilege
        return "read_only"
    if state.startswith(("08", "57P")):  # connection exceptions, admin/crash shutdown, cannot connect now
        return "store_unreachable"
    if state == "57014":  # query_canceled (statement_timeout)
        return "store_timeout"
    return "store_error"
