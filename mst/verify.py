"""Full verification of a repository CAR export (resync path).

Checks: CAR framing and every block hash, the commit (schema, DID, signature), and a walk of the
whole MST (every node present, canonical encoding, key heights, strict global key order), plus
that every record block is present. Pure; raises typed errors:
:class:`CARError`, :class:`CommitError` (``commit_missing``, ``commit_did_mismatch``,
``commit_bad_signature`` and the decoding reasons), :class:`MSTError`/:class:`MissingBlockError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mst.car import read_car
from mst.cid import CID
from mst.commit import Commit, decode_commit, verify_commit_sig
from mst.crypto import PublicKey, parse_did_key
from mst.errors import CommitError, MissingBlockError, MSTError
from mst.native import ACCEL
from mst.node import BlockMap, iter_items, load_node

__all__ = ["VerifiedRepo", "tree_records", "verify_repo_car"]


@dataclass(frozen=True, slots=True)
class VerifiedRepo:
    commit: Commit
    commit_cid: CID
    records: dict[str, CID]
    blocks: dict[CID, bytes]


def verify_repo_car(
    car_bytes: bytes,
    did: str,
    public_key: PublicKey | str | None,
    *,
    require_records: bool = True,
    max_blocks: int = 10_000_000,
) -> VerifiedRepo:
    """Verify a full-repo CAR for ``did``; ``public_key`` ``None`` skips only the signature."""
    car = read_car(car_bytes, max_blocks=max_blocks)
    commit_cid = car.roots[0]
    block = car.blocks.get(commit_cid)
    if block is None:
        raise CommitError("commit_missing", "commit block not in CAR")
    commit = decode_commit(block)
    if commit.did != did:
        raise CommitError("commit_did_mismatch", f"commit is for {commit.did[:100]}")
    if public_key is not None:
        pk = parse_did_key(public_key) if isinstance(public_key, str) else public_key
        if not verify_commit_sig(commit, pk):
            raise CommitError("commit_bad_signature", "signature does not verify")
    blocks = car.blocks
    records = _records(blocks, commit.data, require_records)
    return VerifiedRepo(commit, commit_cid, records, blocks)


def tree_records(blocks: BlockMap, data: CID, require_records: bool) -> dict[str, CID]:
    """Every ``path -> record CID`` of the tree rooted at ``data``, walking the whole tree (every
    node present and valid, strict global key order; with ``require_records`` every record block
    present). The reference implementation (see ``_records``)."""
    root = load_node(blocks, data, None)
    records: dict[str, CID] = {}
    prev = b""
    for key, cid in iter_items(blocks, None if root.is_empty else root):
        if key <= prev:
            raise MSTError("mst_key_order", "keys out of order across nodes")
        prev = key
        if require_records and cid not in blocks:
            raise MissingBlockError(cid, f"record {key.decode()} missing")
        records[key.decode()] = cid
    return records


def _accelerated_records(blocks: BlockMap, data: CID, require_records: bool) -> dict[str, CID]:
    """:func:`tree_records` by the native path (``mst._accel``), the reference for what it declines."""
    got: dict[str, CID] | None = _accel.records(blocks, data, require_records)
    return got if got is not None else tree_records(blocks, data, require_records)


if ACCEL:
    from mst.accel import module

    _accel = module()
    _records = _accelerated_records
else:
    _records = tree_records
