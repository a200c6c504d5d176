"""Fetch one repository, verify it completely, and judge it against the relay's stored state.

Pure judgement (``judge``) is separated from I/O (``fetch_verified``) so it is testable alone.

* ``fetch_verified(fetcher, identities, did) -> FetchedRepo``: ``getRepo`` from the account's
  host, resolve the DID's signing key, then ``mst.verify.verify_repo_car`` (commit signature,
  every block hash, the full MST walk). Raises ``CheckError(reason)``; reasons are the fetch and
  identity reasons plus the repository core's (``RepoError.reason``), ``did_mismatch`` and
  ``pds_mismatch`` (the DID document names another host: nothing is fetched).
* ``judge(stored, fetched) -> Judgement``: ``ok`` when the stored commit/data/rev equal the
  fetched ones (or the relay is already ahead: ``relay_ahead``); otherwise ``queued`` (a ``#sync``
  is queued for the relay, which applies it or finds it stale) with reason ``state_missing``,
  ``state_diverged`` or ``desync_cleared``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mst.errors import ReasonError
from spark.fetch import FetchError, HostFetcher
from spark.identity import IdentityClient, IdentityError


class CheckError(ReasonError):
    """``reason`` is a snake_case label."""


@dataclass(slots=True)
class StoredAccount:
    """The relay's row for one account (the columns the jobs need)."""

    did: str
    host: str | None
    rev: str | None
    commit_cid: str | None
    data_cid: str | None
    sync_state: str
    upstream_status: str = "active"


@dataclass(slots=True)
class FetchedRepo:
    did: str
    rev: str
    commit_cid: str
    data_cid: str
    commit_block: bytes
    records: dict[str, Any]  # path → CID
    blocks: Any  # CID → bytes
    size: int


@dataclass(slots=True)
class Judgement:
    outcome: str  # ok | repaired
    reason: str | None


def fetch_verified(fetcher: HostFetcher, identities: IdentityClient, did: str) -> FetchedRepo:
    """Download and fully verify ``did``'s repository (see the module docstring)."""
    from mst.cid import cid_str
    from mst.crypto import parse_did_key
    from mst.errors import RepoError
    from mst.verify import verify_repo_car

    try:
        ident = identities.resolve(did)
    except IdentityError as exc:
        raise CheckError(exc.reason, did) from exc
    if not same_host(ident.pds, fetcher.base_url):
        # a former host may still serve an old, validly signed copy: only the DID's PDS counts
        raise CheckError("pds_mismatch", did)
    try:
        result = fetcher.get("/xrpc/com.atproto.sync.getRepo", {"did": did})
    except FetchError as exc:
        raise CheckError(exc.reason, did) from exc
    car = result.content
    try:
        key = parse_did_key(ident.signing_key)
        verified = verify_repo_car(car, did, key)
    except RepoError as exc:
        raise CheckError(exc.reason or "repo_invalid", did) from exc
    except Exception as exc:  # a defect in a decoder must not kill the whole task
        raise CheckError("verify_crashed", f"{did}: {type(exc).__name__}") from exc
    commit = verified.commit
    if commit.did != did:
        raise CheckError("did_mismatch", did)
    commit_block = verified.blocks[verified.commit_cid]
    return FetchedRepo(
        did=did,
        rev=commit.rev,
        commit_cid=cid_str(verified.commit_cid),
        data_cid=cid_str(commit.data),
        commit_block=bytes(commit_block),
        records=dict(verified.records),
        blocks=verified.blocks,
        size=len(car),
    )


def same_host(pds: str | None, base_url: str) -> bool:
    """True when the DID document's PDS endpoint names the host being asked (host[:port])."""
    if not pds:
        return False
    return urlsplit(pds).netloc.lower() == urlsplit(base_url).netloc.lower()


def judge(stored: StoredAccount, fetched: FetchedRepo) -> Judgement:
    """Compare the relay's state with a verified repository (pure)."""
    same = (
        stored.commit_cid == fetched.commit_cid
        and stored.data_cid == fetched.data_cid
        and stored.rev == fetched.rev
    )
    if same:
        if stored.sync_state != "synced":
            return Judgement("queued", "desync_cleared")
        return Judgement("ok", None)
    if stored.rev is None or stored.commit_cid is None:
        return Judgement("queued", "state_missing")
    if stored.rev > fetched.rev:
        return Judgement("ok", "relay_ahead")
    return Judgement("queued", "state_diverged")


def sync_blocks(fetched: FetchedRepo) -> bytes:
    """The ``blocks`` of a ``#sync`` event: a CAR whose root is the commit and whose only block
    is the signed commit."""
    from mst.car import write_car
    from mst.cid import parse_cid

    cid = parse_cid(fetched.commit_cid)
    return write_car([cid], [(cid, fetched.commit_block)])
