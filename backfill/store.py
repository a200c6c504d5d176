"""The durable store behind the relay: events (the backfill window), accounts, hosts, domain bans
and the seq high-water mark. One async interface, two backends:

* ``postgresql://…`` (or ``postgres://…``) → ``backfill.postgres_store.PostgresStore`` (asyncpg);
  an optional ``schema`` (keyword, or ``?schema=name`` in the URL) isolates one relay (or test)
  in its own schema — locks are per schema too.
* anything else → ``backfill.sqlite_store.SqliteStore``, the embedded default; the URL is a file
  path (``sqlite:///abs/path`` and ``sqlite:relative/path`` are accepted too).

Both implement what does not depend on the SQL dialect once, in ``backfill.sql_store.SqlStore``
(the store core), and keep only their dialect: SQL text, connections, locking.

Only the sequencer writes events (through a ``WriterLease``); everything else here is safe to
call from any task, process or replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from backfill.identities import Identity, IdentityWrite
from backfill.types import HostState
from firehose.state import AccountState, SequencedEvent

DEFAULT_SQLITE_PATH = "./data/relay.sqlite"


def writer_identity() -> str:
    """How a writer lease taken by this process names its holder: ``<hostname> pid <pid>`` (on
    Kubernetes the hostname is the pod's name). Shown to a standby waiting for the lease."""
    return f"{socket.gethostname()} pid {os.getpid()}"
#: seq is kept below 2**53 so that every JSON/JavaScript consumer can represent it exactly.
SEQ_LIMIT = 2**53
#: Default backfill window (72 hours).
DEFAULT_RETENTION_SECONDS = 72 * 3600


@dataclass(slots=True)
class BatchWrite:
    """Everything one sequencer batch persists in a single transaction.

    ``expected_high_water`` is the stored mark the batch was numbered from; the write fails
    (``SequencerConflictError``) unless it is still the stored value, so seq can never be reused.
    ``events`` rows are ``(seq, did, kind, time, frame)`` in seq order. ``host_updates`` maps a
    hostname to ``(upstream cursor or None, last_seen or None, account_count delta)``.
    ``collection_resets`` (did → complete counts; first; the account's counts become exact) and
    ``collection_deltas`` (``(collection, did, delta, floor)``: ``records = max(floor, records +
    delta)``, and at least 1 for an existing row of an account whose counts are not exact; rows
    at 0 removed) keep ``repo_collections`` (``backfill.collections``); written after the accounts.
    ``upstream_done`` rows ``(host, upstream seq)``: frames stored above the cursor their event
    carried, which a re-read must skip (migration 0010; ``Store.upstream_done_above``).
    ``accounts`` replace their rows, except that a state without a rev keeps the stored head
    (rev, commit and data CIDs: ``backfill.sql_store.keep_head_sql``).
    """

    expected_high_water: int
    new_high_water: int
    events: list[tuple[int, str, str, float, bytes]] = field(default_factory=list)
    accounts: list[AccountState] = field(default_factory=list)
    host_updates: dict[str, tuple[int | None, float | None, int]] = field(default_factory=dict)
    collection_resets: dict[str, dict[str, int]] = field(default_factory=dict)
    collection_deltas: list[tuple[str, str, int, int]] = field(default_factory=list)
    upstream_done: list[tuple[str, int]] = field(default_factory=list)

    @property
    def frame_bytes(self) -> int:
        return sum(len(row[4]) for row in self.events)


class WriterLease(ABC):
    """The single-writer right on one database (or schema), held until ``release``.

    Postgres: a session advisory lock on a dedicated connection, which is also the connection
    every batch is written through (if it dies, the lock and the write die together).
    SQLite: an exclusive ``flock`` on ``<db>.writer.lock``.
    """

    @abstractmethod
    async def commit_batch(self, batch: BatchWrite) -> None:
        """Persist ``batch`` atomically (see ``BatchWrite``)."""

    @abstractmethod
    async def high_water(self) -> int:
        """The stored seq high-water mark, read through the lease."""

    @abstractmethod
    async def release(self) -> None:
        """Give up the lease (idempotent)."""


def host_count_deltas(existed: bool, old_host: str | None, new_host: str | None) -> dict[str, int]:
    """Account-count changes per host when an account (new unless ``existed``; previously on
    ``old_host``) is now stored on ``new_host``."""
    deltas: dict[str, int] = {}
    if existed and old_host == new_host:
        return deltas
    if existed and old_host is not None:
        deltas[old_host] = deltas.get(old_host, 0) - 1
    if new_host is not None:
        deltas[new_host] = deltas.get(new_host, 0) + 1
    return deltas


def retention_prefix(
    rows: Sequence[tuple[int, float, int]],
    cutoff_time: float | None,
    excess_bytes: int,
) -> tuple[int, int]:
    """How many of the oldest ``rows`` (``(seq, time, size)`` in seq order) to delete.

    A row goes when it is older than ``cutoff_time`` (times never decrease along seq, so this is
    a prefix) or while the deleted bytes are still below ``excess_bytes``. Returns
    ``(count, bytes)``.
    """
    count = 0
    freed = 0
    for _seq, time_, size in rows:
        too_old = cutoff_time is not None and time_ < cutoff_time
        too_big = freed < excess_bytes
        if not (too_old or too_big):
            break
        count += 1
        freed += size
    return count, freed


class Store(ABC):
    """Async interface shared by both backends. See the module docstring."""

    #: "postgres" or "sqlite"
    backend: str = ""

    # -- lifecycle ---------------------------------------------------------------------------
    @abstractmethod
    async def migrate(self) -> list[int]:
        """Apply pending migrations in numeric order; returns the versions applied now.

        Safe to run twice and from several processes at once (they serialise on a lock)."""

    @abstractmethod
    async def applied_migrations(self) -> list[int]:
        """Versions recorded in ``schema_migrations``."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection (idempotent)."""

    @abstractmethod
    async def acquire_writer(self, *, wait: bool = False, timeout: float | None = None) -> WriterLease:
        """Take the single-writer lease. With ``wait=False`` (or when ``timeout`` runs out) raise
        ``SequencerLockedError`` if another writer holds it."""

    async def writer_holder(self) -> str | None:
        """Who holds the writer lease now, as the database tells it (``writer_identity()`` of the
        holder, plus what the backend knows of its connection); None when nobody holds it or
        the backend cannot tell. For logs and health only: never a basis for a decision."""
        return None

    def is_transient(self, exc: BaseException) -> bool:
        """True when ``exc`` means "the database is unavailable right now" (connection lost or
        refused, server shutting down or starting, a lock or I/O timeout) rather than "this write is
        wrong": the sequencer then holds its batch and retries instead of failing anyone."""
        return isinstance(exc, OSError | TimeoutError | ConnectionError)

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- events ------------------------------------------------------------------------------
    @abstractmethod
    async def read_after(self, cursor: int, limit: int = 1000) -> list[SequencedEvent]:
        """Up to ``limit`` events with ``seq > cursor``, in seq order (one index seek)."""

    @abstractmethod
    async def oldest_seq(self) -> int | None:
        """The oldest seq still in the window, or None when the window is empty."""

    @abstractmethod
    async def latest_seq(self) -> int:
        """The seq high-water mark: the last seq ever assigned (0 before the first event).

        It survives trimming and ``TRUNCATE events``."""

    @abstractmethod
    async def count_events(self) -> int:
        """Number of events in the window (a full count: for tests and admin, not hot paths)."""

    @abstractmethod
    async def events_bytes(self) -> int:
        """Total frame bytes in the window, as maintained by the sequencer and ``trim``."""

    @abstractmethod
    async def trim(
        self,
        older_than_seconds: float | None = None,
        max_bytes: int | None = None,
        batch: int = 2000,
        *,
        now: float | None = None,
    ) -> int:
        """Delete the oldest events that are older than ``older_than_seconds`` or beyond
        ``max_bytes`` of frames, ``batch`` rows per short transaction. Returns rows deleted."""

    async def follow(
        self, cursor: int, *, page: int = 1000, poll_interval: float = 0.1
    ) -> AsyncIterator[SequencedEvent]:
        """Replay from ``cursor`` then keep polling for new events (a live tail for callers
        without a bus). Runs until the consumer stops iterating."""
        while True:
            events = await self.read_after(cursor, page)
            for event in events:
                yield event
            if events:
                cursor = events[-1].seq
            if len(events) < page:
                await asyncio.sleep(poll_interval)

    # -- accounts ----------------------------------------------------------------------------
    @abstractmethod
    async def get_account(self, did: str) -> AccountState | None: ...

    @abstractmethod
    async def account_heads(self, dids: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
        """``did -> (host, rev)`` for the stored accounts among ``dids`` (the sequencer's
        re-delivery check; lighter than ``get_accounts``)."""

    @abstractmethod
    async def get_accounts(self, dids: Iterable[str]) -> dict[str, AccountState]:
        """The stored accounts among ``dids`` (missing ones are absent from the dict)."""

    @abstractmethod
    async def upsert_account(self, state: AccountState) -> None:
        """Insert or replace one account (admin/resync path; keeps host account counts); a state
        without a rev keeps the stored head (rev, commit and data CIDs)."""

    @abstractmethod
    async def list_accounts(self, after_did: str | None = None, limit: int = 500) -> list[AccountState]:
        """Accounts ordered by DID, strictly after ``after_did`` (listRepos paging)."""

    @abstractmethod
    async def accounts_by_sync_state(
        self, state: str, limit: int = 500, *, after_did: str | None = None
    ) -> list[AccountState]:
        """Up to ``limit`` accounts in ``sync_state``, ordered by DID, strictly after
        ``after_did`` (indexed for every state except "synced")."""

    @abstractmethod
    async def count_accounts(self, host: str | None = None) -> int:
        """Accounts on ``host`` (all accounts when None), counted from the accounts table."""

    # -- collections (backfill.collections; written by the sequencer) ------------------------
    @abstractmethod
    async def list_repos_by_collection(self, collection: str, after_did: str | None = None,
                                       limit: int = 500) -> list[str]:
        """DIDs of active accounts with at least one record in ``collection``, ascending, after
        ``after_did``, at most ``limit``."""

    @abstractmethod
    async def collection_counts(self, did: str) -> dict[str, int]:
        """The stored record counts per collection of one account."""

    @abstractmethod
    async def count_accounts_by_host(self, sync_state: str) -> dict[str, int]:
        """Accounts in ``sync_state`` (e.g. ``throttled``: held over a host's limit) per host."""

    # -- persisted identities (migration 0090; see backfill.identities) -------------------------
    @abstractmethod
    async def get_identities(self, dids: Iterable[str]) -> dict[str, Identity | None]:
        """The stored identities among ``dids``: None for a purged row, absent when never stored."""

    @abstractmethod
    async def write_identities(self, writes: Sequence[IdentityWrite]) -> None:
        """Upsert identities and purges (one row per DID, at most once each) in one transaction;
        a write older (``fetched_at`` / ``at``) than the stored row is skipped."""

    # -- hosts -------------------------------------------------------------------------------
    @abstractmethod
    async def get_host(self, hostname: str) -> HostState | None: ...

    @abstractmethod
    async def list_hosts(self, after: str | None = None, limit: int = 500) -> list[HostState]:
        """Hosts ordered by hostname, strictly after ``after``."""

    @abstractmethod
    async def upsert_host(self, host: HostState) -> None:
        """Insert a host, or update its configuration (status, account_limit, trusted, rate
        limits, last_seen when given). The upstream cursor and account count of an existing host
        are left alone: the sequencer owns them (use ``set_host_cursor`` to reset a cursor)."""

    @abstractmethod
    async def set_host_status(self, hostname: str, status: str) -> bool:
        """Set a known host's status; False when the host is unknown."""

    @abstractmethod
    async def host_cursor(self, hostname: str) -> int | None:
        """The durable upstream cursor of ``hostname`` (None when unknown)."""

    @abstractmethod
    async def set_host_cursor(self, hostname: str, cursor: int) -> bool:
        """Overwrite a host's upstream cursor (admin reset, e.g. after the host restarted its
        sequence), forgetting the host's ``upstream_done`` rows; False when the host is unknown."""

    @abstractmethod
    async def upstream_done_above(self, hostname: str, cursor: int) -> list[int]:
        """The upstream seqs above ``cursor`` recorded as done for ``hostname`` (``BatchWrite.
        upstream_done``); the rows at or below it are deleted on the way."""

    # -- domain bans -------------------------------------------------------------------------
    @abstractmethod
    async def list_domain_bans(self) -> list[str]:
        """Banned domains, sorted."""

    @abstractmethod
    async def add_domain_ban(self, domain: str) -> bool:
        """Ban ``domain`` (lower-cased); False when it was already banned."""

    @abstractmethod
    async def remove_domain_ban(self, domain: str) -> bool:
        """Lift a ban; False when there was none."""

    # -- operator state that survives restarts (migration 0050: relay_settings, crawl_requests,
    # admin_audit) ------------------------------------------------------------------------------
    @abstractmethod
    async def get_setting(self, key: str) -> str | None:
        """A stored operator setting, or None."""

    @abstractmethod
    async def set_setting(self, key: str, value: str) -> None:
        """Store (insert or replace) an operator setting."""

    @abstractmethod
    async def record_crawl_admission(self, hostname: str, at: float) -> None:
        """Note that a public ``requestCrawl`` admitted the new host ``hostname`` at ``at``."""

    @abstractmethod
    async def count_crawl_admissions(self, since: float) -> int:
        """Public admissions of new hosts at or after ``since`` (the new-hosts-per-day window)."""

    @abstractmethod
    async def record_admin_action(self, at: float, action: str, target: str, detail: str) -> None:
        """Append one audit entry (``detail`` is a JSON object as text)."""

    @abstractmethod
    async def list_admin_actions(self, limit: int = 200) -> list[dict[str, Any]]:
        """The most recent ``limit`` audit entries, oldest first: ``{time, action, target, detail}``
        with ``detail`` decoded."""

    # -- the Spark repair outbox (migration 0070; see backfill.outbox) --------------------------
    @abstractmethod
    async def pending_repairs(self, limit: int = 500, after_id: int = 0) -> list[dict[str, Any]]:
        """Unconsumed outbox rows with ``id > after_id``, in queue order (columns of
        ``backfill.sql_store.PENDING_REPAIRS_COLUMNS``)."""

    @abstractmethod
    async def mark_repair_consumed(self, row_id: int, at: float, seq: int | None, outcome: str) -> None:
        """Mark one outbox row consumed (``seq``: the event it became, None if it became none;
        ``outcome``: what the relay did with it, see ``backfill.outbox``)."""


def audit_entry(at: float, action: str, target: str, detail: str) -> dict[str, Any]:
    """One ``admin_audit`` row as the API shows it (``detail`` decoded; kept as text if it is not JSON)."""
    try:
        decoded: Any = json.loads(detail)
    except ValueError:
        decoded = detail
    return {"time": at, "action": action, "target": target, "detail": decoded}


def split_schema(url: str) -> tuple[str, str | None]:
    """Pull a ``schema=`` query parameter out of a Postgres URL."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = None
    rest = []
    for key, value in query:
        if key == "schema":
            schema = value or None
        else:
            rest.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(rest))), schema


def sqlite_path_from_url(url: str | None) -> str:
    """The file path for a non-Postgres URL (``None``/empty → the embedded default)."""
    if not url:
        return DEFAULT_SQLITE_PATH
    if url.startswith("sqlite:///"):
        return url[len("sqlite://") :]
    if url.startswith("sqlite://"):
        return url[len("sqlite://") :]
    if url.startswith("sqlite:"):
        return url[len("sqlite:") :]
    return url


def is_postgres_url(url: str | None) -> bool:
    return url is not None and url.split(":", 1)[0] in ("postgresql", "postgres")
