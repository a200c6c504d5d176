"""Covering proofs: the MST node blocks that prove a path's presence or absence *and* let a
consumer invert an operation on that path (sync 1.1 CAR slices).

For each path: every node on the search path from the root; if the path is present, also the
right spine of the subtree left of it and the left spine of the subtree right of it (deleting
the key merges those two subtrees); if absent, the search path runs down to the empty slot
(inserting the key splits every node on it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from mst.cid import CID
from mst.node import BlockMap, Node, child, load_node

__all__ = ["covering_blocks", "covering_nodes"]


def _spine(store: BlockMap, n: Node | None, rightmost: bool, out: dict[CID, Node]) -> None:
    while n is not None:
        out[n.cid] = n
        n = child(store, n, len(n.subs) - 1 if rightmost else 0)


def covering_nodes(store: BlockMap, root: Node, keys: Iterable[bytes]) -> dict[CID, Node]:
    """The covering-proof nodes for ``keys`` in the tree rooted at ``root`` (see module doc)."""
    out: dict[CID, Node] = {}
    for key in keys:
        n: Node | None = root
        while n is not None:
            out[n.cid] = n
            i = bisect_left(n.keys, key)
            if i < len(n.keys) and n.keys[i] == key:
                _spine(store, child(store, n, i), True, out)
                _spine(store, child(store, n, i + 1), False, out)
                break
            n = child(store, n, i)
    return out


def covering_blocks(store: BlockMap, root: CID, paths: Iterable[str]) -> dict[CID, bytes]:
    """``{cid: block}`` of the covering proof of ``paths`` in the stored tree ``root``."""
    nodes = covering_nodes(store, load_node(store, root, None), (p.encode() for p in paths))
    return {cid: n.encode() for cid, n in nodes.items()}
