"""Persisted identities (table ``identities``, migration 0090): the value type and its row form,
shared by both store backends and by ``relay.identity`` (which resolves them).

A row is either an identity (``signing_key`` set) or a *purge* (``signing_key`` NULL): the
relay learned that the DID's document changed (``#identity``) or that the DID is gone, so the
row must not be served again. Every write carries ``fetched_at`` — the wall-clock time the
resolution was sent, or the purge made — and lands only if it is not older than the stored row
(``FRESHER_ONLY``), so a slow resolution that started before a purge, possibly in another
process, cannot bring the old document back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

IDENTITY_COLS = "did, signing_key, pds, handle, handle_verified, handle_checked_at, fetched_at"
#: ``ON CONFLICT`` tail of both backends' upserts (the table is named in the WHERE clause).
FRESHER_ONLY = (
    "ON CONFLICT (did) DO UPDATE SET signing_key = excluded.signing_key, pds = excluded.pds, "
    "handle = excluded.handle, handle_verified = excluded.handle_verified, "
    "handle_checked_at = excluded.handle_checked_at, fetched_at = excluded.fetched_at "
    "WHERE excluded.fetched_at >= identities.fetched_at"
)


@dataclass(frozen=True, slots=True)
class Identity:
    """What the relay needs to know about an account's identity.

    ``fetched_at`` is when the document was requested (unix seconds; 0 = unknown);
    ``handle_verified`` is whether ``handle`` was checked to resolve back to ``did`` (None: not
    checked since this document was fetched), decided at ``handle_checked_at``."""

    did: str
    signing_key: str  # did:key:…
    pds: str | None = None
    handle: str | None = None
    fetched_at: float = 0.0
    handle_verified: bool | None = None
    handle_checked_at: float | None = None

    @property
    def pds_hostname(self) -> str | None:
        """The PDS endpoint as a relay hostname (``host`` or ``host:port``), lower case."""
        return _hostname(self.pds) if self.pds else None


@lru_cache(maxsize=4096)
def _hostname(endpoint: str) -> str | None:
    """``Identity.pds_hostname`` of ``endpoint``, parsed once per endpoint (read per commit)."""
    return urlsplit(endpoint).netloc.lower() or None


@dataclass(frozen=True, slots=True)
class IdentityPurge:
    """A write that makes ``did``'s stored identity a miss, as of ``at`` (unix seconds)."""

    did: str
    at: float


IdentityWrite = Identity | IdentityPurge


def identity_row(write: IdentityWrite) -> tuple[Any, ...]:
    """The ``IDENTITY_COLS`` values of one write."""
    if isinstance(write, IdentityPurge):
        return (write.did, None, None, None, None, None, write.at)
    return (write.did, write.signing_key, write.pds, write.handle, write.handle_verified,
            write.handle_checked_at, write.fetched_at)


def identity_from_row(row: Sequence[Any]) -> Identity | None:
    """The identity in a row of ``IDENTITY_COLS`` (None for a purged row)."""
    did, key, pds, handle, verified, checked_at, fetched_at = row
    if key is None:
        return None
    return Identity(did, key, pds, handle, fetched_at, None if verified is None else bool(verified), checked_at)
