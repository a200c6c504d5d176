"""Diff of two stored trees as record operations (``RepoOp`` list sorted by path).

Walks both trees layer by layer from the top and drops every subtree whose CID appears in
both at the same layer (identical content), so the cost is proportional to the change, not to
the tree size.
"""

from __future__ import annotations

from mst.cid import CID
from mst.node import BlockMap, Node, child, load_node
from mst.ops import RepoOp

__all__ = ["mst_diff"]


def _collect(store: BlockMap, root: CID) -> dict[CID, Node]:
    n = load_node(store, root, None)
    return {} if n.is_empty else {root: n}


def mst_diff(store: BlockMap, root_a: CID, root_b: CID) -> list[RepoOp]:
    """Operations that turn tree ``root_a`` into tree ``root_b`` (creates, updates with
    ``prev``, deletes with ``prev``), sorted by path."""
    if root_a == root_b:
        return []
    front_a = _collect(store, root_a)
    front_b = _collect(store, root_b)
    leaves_a: dict[bytes, CID] = {}
    leaves_b: dict[bytes, CID] = {}
    while front_a or front_b:
        layer = max(n.layer for n in (*front_a.values(), *front_b.values()))
        for front, leaves, other in ((front_a, leaves_a, front_b), (front_b, leaves_b, front_a)):
            for cid in [c for c, n in front.items() if n.layer == layer]:
                n = front.pop(cid)
                if cid in other and other[cid].layer == layer:
                    other.pop(cid)
                    continue
                leaves.update(zip(n.keys, n.vals, strict=True))
                for i in range(len(n.subs)):
                    c = child(store, n, i)
                    if c is not None:
                        front[c.cid] = c
    ops: list[RepoOp] = []
    for key in sorted(leaves_a.keys() | leaves_b.keys()):
        a, b = leaves_a.get(key), leaves_b.get(key)
        path = key.decode()
        if a is None:
            ops.append(RepoOp("create", path, b, None))
        elif b is None:
            ops.append(RepoOp("delete", path, None, a))
        elif a != b:
            ops.append(RepoOp("update", path, b, a))
    return ops
