"""Blocks a ``#commit``'s CAR slice carries that nothing references are dropped, not passed on.

The sync draft (§4.1.1) lets a diff "include additional blocks; receivers SHOULD ignore them", so
a commit carrying them is valid and must not be rejected (the account would desynchronise over
something the protocol allows). But the relay must not pass them on either: an 824-byte commit
padded with 40,000 unreferenced blocks would otherwise go out as a 1.7 MB frame to every consumer.

What is kept (:func:`referenced`): the commit block; every MST node reachable from the commit's
``data`` root through nodes present in the slice (the new tree's nodes the producer sent: a
superset of what any implementation's inversion needs, so every consumer can still verify the
commit); and the blocks of the ops' record CIDs. Everything else — unreferenced blocks, record
blocks that no op names (deleted records' data, which the draft excludes from diffs), extra CAR
roots — is dropped, and the slice re-serialised with the commit as its only root.

Pure and I/O-free. Reachable nodes are authentic (each hashes to the link in its signed parent),
so what they link to is part of the signed tree; records are kept but never followed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from mst.car import Car, write_car
from mst.cid import CID, DAG_CBOR_PREFIX

__all__ = ["Recording", "prune_slice", "referenced"]


class Recording(Mapping[CID, bytes]):
    """A read-only view of a slice's blocks that remembers which ones were read (``seen``): given
    to the operation inversion, it names the nodes the inversion used, so that a slice holding
    only those, the commit and the records needs no walk at all (:func:`prune_slice`)."""

    __slots__ = ("blocks", "seen")

    def __init__(self, blocks: Mapping[CID, bytes]) -> None:
        self.blocks = blocks
        self.seen: set[CID] = set()

    def get(self, key: CID, default: bytes | None = None) -> bytes | None:  # type: ignore[override]
        block = self.blocks.get(key)
        if block is None:
            return default
        self.seen.add(key)
        return block

    def __getitem__(self, key: CID) -> bytes:
        block = self.blocks[key]
        self.seen.add(key)
        return block

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def __iter__(self) -> Iterator[CID]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)


#: A dag-cbor CIDv1/sha2-256 link as DAG-CBOR encodes it: tag 42, bytes(37), 0x00, the CID's prefix.
_LINK = b"\xd8\x2a\x58\x25\x00" + DAG_CBOR_PREFIX
_LINK_BYTES = len(_LINK) - len(DAG_CBOR_PREFIX) + 36
#: The map keys that precede a subtree link in a canonical MST node: ``"l"``, and each entry's ``"t"``.
_SUBTREE_KEYS = (b"\x61l", b"\x61t")


def _node_links(block: bytes) -> list[CID]:
    """The subtree links (``l`` and each entry's ``t``) of an MST node block, found in its bytes
    without decoding it (a few ``find`` calls instead of a full decode per node). Exact for a
    canonical node: its keys are restricted to ASCII, so the link pattern occurs only as a CID,
    and canonical key order puts the key ``l``/``t``/``v`` right before each link. A block that is
    not a node yields only whatever links such bytes happen to name, all of which must still be
    blocks of this slice to be kept."""
    out = []
    find = block.find
    i = find(_LINK)
    while i >= 2:
        if block[i - 2:i] in _SUBTREE_KEYS:
            out.append(CID(block[i + 5:i + _LINK_BYTES]))
        i = find(_LINK, i + _LINK_BYTES)
    return out


def referenced(car: Car, commit_cid: CID, data_root: CID | None, record_cids: Iterable[CID | None]) -> set[CID]:
    """The CIDs of ``car``'s blocks that the commit references (see the module docstring)."""
    blocks = car.blocks
    keep = {commit_cid}
    stack = [data_root] if data_root is not None else []
    while stack:
        cid = stack.pop()
        if cid in keep:
            continue
        block = blocks.get(cid)
        if block is None:
            continue  # not in the slice: an unchanged subtree the producer did not send
        keep.add(cid)
        stack.extend(_node_links(block))
    keep.update(c for c in record_cids if c is not None and c in blocks)
    return keep


def prune_slice(car: Car, commit_cid: CID, data_root: CID | None, record_cids: Iterable[CID | None],
                seen: Iterable[CID] = ()) -> tuple[bytes, int] | None:
    """``(slice without the unreferenced blocks, how many were dropped)``, or None when every block
    is referenced and the commit is the only root (the slice goes out as received). Blocks keep
    their order. ``seen``: blocks already known to be reachable nodes (what the inversion read);
    when they, the commit and the records are the whole slice, the tree is not walked."""
    blocks = car.blocks
    records = [c for c in record_cids if c is not None and c in blocks]
    known = {commit_cid, *seen, *records}
    if len(known) == len(blocks) and len(car.roots) == 1:  # the root is the commit (validated)
        return None
    keep = referenced(car, commit_cid, data_root, records)  # a subset of the slice's blocks
    dropped = len(car.blocks) - len(keep)
    if dropped == 0 and len(car.roots) == 1:  # the one root is the commit (checked by validation)
        return None
    return write_car([commit_cid], ((c, b) for c, b in car.blocks.items() if c in keep)), dropped
