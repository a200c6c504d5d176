"""Operation inversion (sync 1.1): undo a commit's ops on the partial tree of its CAR slice.

Each op is applied in reverse (create -> delete, update -> put ``prev``, delete -> put ``prev``),
last op first, and the resulting root is returned; the caller compares it with ``prevData``.
Pure function over a block map; nothing is written.

Errors: :class:`MissingBlockError` (``missing_block``) if the slice lacks a needed node;
:class:`InversionError` with reasons ``inversion_create_absent`` (a created path is not in the
tree), ``inversion_update_absent``, ``inversion_value_mismatch`` (tree value differs from the
op's ``cid``), ``inversion_delete_present`` (a deleted path is still in the tree),
``inversion_missing_prev`` (update/delete without ``prev``), ``inversion_bad_op``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mst._node import (
    BlockMap,
    checked_height,
    load_node,
    node_get,
    root_delete,
    root_put,
)
from mst.cid import CID
from mst.errors import InversionError
from mst.ops import RepoOp

__all__ = ["invert_ops"]


def invert_ops(blocks: BlockMap, root: CID, ops: Sequence[RepoOp]) -> CID:
    """Root CID of the tree before ``ops`` were applied to the tree rooted at ``root``.

    With no ops the answer is ``root`` itself and no block is needed (a commit that only
    re-signs an unchanged tree carries no MST nodes)."""
    if not ops:
        return root
    node = load_node(blocks, root, None)
    for op in reversed(ops):
        try:
            key = op.path.encode()
        except (AttributeError, UnicodeEncodeError):
            raise InversionError("inversion_bad_op", "op path is not a string") from None
        h = checked_height(key)
        if h < 0:
            raise InversionError("inversion_bad_op", f"invalid path {op.path[:80]!r}")
        current = node_get(blocks, node, key, h)
        action = op.action
        if action == "create":
            if current is None:
                raise InversionError("inversion_create_absent", op.path)
            if current != op.cid:
                raise InversionError("inversion_value_mismatch", op.path)
            node = root_delete(blocks, node, key)
        elif action == "update":
            if current is None:
                raise InversionError("inversion_update_absent", op.path)
            if current != op.cid:
                raise InversionError("inversion_value_mismatch", op.path)
            if op.prev is None:
                raise InversionError("inversion_missing_prev", op.path)
            node = root_put(blocks, node, key, op.prev)
        elif action == "delete":
            if current is not None:
                raise InversionError("inversion_delete_present", op.path)
            if op.prev is None:
                raise InversionError("inversion_missing_prev", op.path)
            node = root_put(blocks, node, key, op.prev)
        else:
            raise InversionError("inversion_bad_op", f"unknown action {str(action)[:20]!r}")
    return node.cid
