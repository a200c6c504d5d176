"""The Merkle Search Tree of an atproto repository (spec: atproto-repository.md, "MST").

:class:`MST` is an immutable value over a block store (``BlockMap``: ``dict[CID, bytes]``-like).
``put``/``delete`` return new trees sharing unchanged nodes; ``root`` computes (and caches) the
CIDs of new nodes only. A tree loaded from an incomplete store is a *partial tree*: operations
that touch a missing block raise :class:`mst.errors.MissingBlockError` (never a guess).

New nodes live in memory until :meth:`MST.persist` copies their blocks into a mutable store
(or :meth:`MST.new_blocks` hands them out), so operations never require a writable store.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping

from mst.cid import CID
from mst.diff import mst_diff
from mst.errors import MSTError
from mst.invert import invert_ops
from mst.node import (
    BlockMap,
    Node,
    empty_node,
    is_valid_mst_key,
    iter_items,
    iter_new_nodes,
    key_height,
    load_node,
    node_get,
    root_delete,
    root_put,
)
from mst.proof import covering_blocks

__all__ = [
    "MST",
    "build",
    "covering_blocks",
    "invert_ops",
    "key_height",
    "mst_diff",
]


def _key(path: str | bytes) -> bytes:
    key = path.encode() if isinstance(path, str) else bytes(path)
    if not is_valid_mst_key(key):
        raise MSTError("mst_key_invalid", f"invalid repo path {key[:80]!r}")
    return key


class MST:
    """An immutable MST: ``MST.empty(store)``, ``MST.load(store, root)``, then ``get``,
    ``put``, ``delete``, ``items`` and ``root``."""

    __slots__ = ("store", "node")

    def __init__(self, store: BlockMap, node: Node) -> None:
        self.store = store
        self.node = node

    @classmethod
    def empty(cls, store: BlockMap) -> MST:
        return cls(store, empty_node())

    @classmethod
    def load(cls, store: BlockMap, root: CID) -> MST:
        """The tree whose root node is ``root`` (raises ``MissingBlockError`` if absent)."""
        return cls(store, load_node(store, root, None))

    @property
    def root(self) -> CID:
        """CID of the root node."""
        return self.node.cid

    @property
    def layer(self) -> int:
        return self.node.layer

    def get(self, path: str | bytes) -> CID | None:
        """Record CID at ``path`` or ``None``."""
        key = _key(path)
        return node_get(self.store, self.node, key, key_height(key))

    def put(self, path: str | bytes, cid: CID) -> MST:
        """A tree with ``path`` set to ``cid``."""
        return MST(self.store, root_put(self.store, self.node, _key(path), cid))

    def delete(self, path: str | bytes) -> MST:
        """A tree without ``path``; raises ``MSTError('mst_key_not_found')`` if absent."""
        return MST(self.store, root_delete(self.store, self.node, _key(path)))

    def items(self) -> Iterator[tuple[str, CID]]:
        """All ``(path, cid)`` pairs in key order (needs every node block)."""
        for k, v in iter_items(self.store, None if self.node.is_empty else self.node):
            yield k.decode(), v

    def new_blocks(self) -> Iterator[tuple[CID, bytes]]:
        """``(cid, block)`` of every node not yet in the store."""
        for n in iter_new_nodes(self.node):
            yield n.cid, n.encode()

    def persist(self, store: MutableMapping[CID, bytes] | None = None) -> list[CID]:
        """Write every new node block into ``store`` (default: this tree's store, which must then
        be mutable) and mark them stored; returns the CIDs written."""
        target = store if store is not None else self.store
        written = []
        for n in list(iter_new_nodes(self.node)):
            target[n.cid] = n.encode()  # type: ignore[index]
            n.stored = True
            written.append(n.cid)
        return written

    def __repr__(self) -> str:
        return f"MST(root={self.root.encode()}, layer={self.layer})"


def build(store: MutableMapping[CID, bytes], entries: Iterable[tuple[str | bytes, CID]]) -> CID:
    """Build the tree of ``entries`` (any order), write its node blocks into ``store``, return
    the root CID. The shape depends only on the entry set."""
    tree = MST.empty(store)
    for path, cid in sorted(((_key(p), c) for p, c in entries), key=lambda e: e[0]):
        tree = MST(store, root_put(store, tree.node, path, cid))
    tree.persist()
    return tree.root
