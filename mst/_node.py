"""MST nodes and the persistent tree algorithms behind :class:`mst.mst.MST`.

A node at ``layer`` L holds sorted keys of height L and ``len(keys) + 1`` subtree slots
(``subs[0]`` is the wire ``l``, ``subs[i + 1]`` the wire ``t`` of entry i). A slot is ``None``,
a loaded :class:`Node` (layer L-1) or a :class:`CID` not loaded yet; slots are loaded lazily
from the block store and a block that is absent raises :class:`MissingBlockError` — a partial
tree is therefore simply a tree over an incomplete store, whose untouched subtrees stay opaque.

All algorithms are persistent: they return new nodes and never change the meaning of existing
ones (loading a slot only memoises). Encodings and CIDs are computed once per node and cached.

Wire format (atproto repository spec): ``{"e": [{"k", "p", "t", "v"}], "l"}`` with mandatory
prefix compression. Decoding checks everything needed for the encoding to be canonical, so a
loaded node keeps the CID it was loaded by.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import Union

from mst import cbor
from mst.cbor import encode_head
from mst.cid import CID, DAG_CBOR_PREFIX, RAW_PREFIX, cid_for_cbor, sha256_digest, sha256_small
from mst.errors import CBORError, MissingBlockError, MSTError

__all__ = [  # what ``mst.node`` re-exports from whichever build is in use
    "MAX_KEY_BYTES",
    "BlockMap",
    "Node",
    "Sub",
    "checked_height",
    "child",
    "common_prefix_len",
    "decode_node",
    "empty_node",
    "encode_node",
    "is_valid_mst_key",
    "iter_items",
    "iter_new_nodes",
    "key_height",
    "load_node",
    "merge",
    "node_delete",
    "node_get",
    "node_put",
    "root_delete",
    "root_put",
    "split",
    "sub_cid",
]

BlockMap = Mapping[CID, bytes]
Sub = Union["Node", CID, None]

MAX_KEY_BYTES = 1024
_MST_KEY_RE = re.compile(rb"[a-zA-Z0-9_~:.\-]+/[a-zA-Z0-9_~:.\-]+")
_key_fullmatch = _MST_KEY_RE.fullmatch
# height of recently seen *valid* keys (validity + height in one lookup); bounded, cleared when full
_HEIGHTS: dict[bytes, int] = {}
_HEIGHTS_MAX = 200_000


def key_height(key: bytes) -> int:
    """Layer of a key: leading zero bits of SHA-256(key), counted in 2-bit steps."""
    digest = sha256_digest(key)
    n = int.from_bytes(digest[:8], "big")
    if n:
        return (64 - n.bit_length()) >> 1
    zeros = 64
    for byte in digest[8:]:
        if byte:
            zeros += 8 - byte.bit_length()
            break
        zeros += 8
    return zeros >> 1


def common_prefix_len(a: bytes, b: bytes) -> int:
    """Number of leading bytes shared by ``a`` and ``b``."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n - ((x.bit_length() + 7) >> 3)


def checked_height(key: bytes) -> int:
    """Height of ``key`` if it is a valid MST key, else -1 (cached for valid keys)."""
    h = _HEIGHTS.get(key)
    if h is not None:
        return h
    if len(key) > MAX_KEY_BYTES or _key_fullmatch(key) is None:  # is_valid_mst_key, inlined
        return -1
    # key_height, inlined for the common case (a non-zero first 8 digest bytes)
    n = int.from_bytes(sha256_small(key).digest()[:8], "big")
    h = (64 - n.bit_length()) >> 1 if n else key_height(key)
    if len(_HEIGHTS) >= _HEIGHTS_MAX:
        _HEIGHTS.clear()
    _HEIGHTS[key] = h
    return h


def is_valid_mst_key(key: bytes) -> bool:
    """``<collection>/<rkey>`` with the repo-path character set, at most 1024 bytes."""
    return len(key) <= MAX_KEY_BYTES and _MST_KEY_RE.fullmatch(key) is not None


class Node:
    """One MST node (see module docstring). Treat as immutable."""

    __slots__ = ("layer", "keys", "vals", "subs", "_cid", "_enc", "stored", "patch")

    def __init__(
        self,
        layer: int,
        keys: list[bytes],
        vals: list[CID],
        subs: list[Sub],
        cid: CID | None = None,
        enc: bytes | None = None,
        stored: bool = False,
    ) -> None:
        self.layer = layer
        self.keys = keys
        self.vals = vals
        self.subs = subs
        self._cid = cid
        self._enc = enc
        self.stored = stored  # True if the block is known to be in the store
        # (base encoding, substitutions): this node equals the node encoded as ``base`` except
        # for the links named by the substitutions (``(slot, old link bytes)``; slot ``i >= 0``
        # is subtree slot i, ``-1 - j`` is value j), so its encoding is ``base`` with those
        # links' 36 bytes swapped (see :func:`_patched`)
        self.patch: tuple[bytes, tuple[tuple[int, bytes], ...]] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.keys and self.subs[0] is None

    def encode(self) -> bytes:
        """Canonical DAG-CBOR bytes of this node (cached)."""
        enc = self._enc
        if enc is None:
            patch = self.patch
            if patch is not None:
                enc = _patched(self, patch)
                self.patch = None
            if enc is None:
                enc = encode_node(self.keys, self.vals, [sub_cid(s) for s in self.subs])
            self._enc = enc
        return enc

    @property
    def cid(self) -> CID:
        """CID of this node's block (cached)."""
        c = self._cid
        if c is None:
            c = self._cid = cid_for_cbor(self.encode())
        return c

    def __repr__(self) -> str:
        return f"Node(layer={self.layer}, keys={[k.decode() for k in self.keys]})"


_LINK = b"\xd8\x2a\x58\x25\x00"  # tag 42, bytes(37), multibase identity prefix


def _patched(node: Node, patch: tuple[bytes, tuple[tuple[int, bytes], ...]]) -> bytes | None:
    """``node``'s encoding made from its base encoding by swapping links, or ``None`` when a
    link cannot be swapped unambiguously (then the caller encodes in full)."""
    enc, subst = patch
    for slot, old in subst:
        if slot >= 0:
            tag = b"\x61l" if slot == 0 else b"\x61t"
            new = sub_cid(node.subs[slot])
        else:
            tag = b"\x61v"
            new = node.vals[-1 - slot]
        if new is None or len(new.cid_bytes) != 36:
            return None
        pattern = tag + _LINK + old
        at = enc.find(pattern)
        if at < 0 or enc.find(pattern, at + 1) >= 0:  # absent or ambiguous: encode in full
            return None
        enc = b"".join((enc[:at], tag, _LINK, new.cid_bytes, enc[at + len(pattern) :]))
    return enc


def _link_bytes(sub: Sub) -> bytes | None:
    """The link bytes of a slot when already known without encoding anything."""
    if sub is None:
        return None
    c = sub._cid if type(sub) is Node else sub
    if c is None:
        return None
    b = c.cid_bytes  # type: ignore[union-attr]
    return b if len(b) == 36 else None


def _derive(node: Node, slot: int, n: Node) -> None:
    """Give ``n`` (``node`` with the link at ``slot`` replaced) a patch recipe if possible."""
    if node._enc is not None:
        base: bytes = node._enc
        subst: tuple[tuple[int, bytes], ...] = ()
    elif node.patch is not None:
        base, subst = node.patch
        if any(s == slot for s, _ in subst):  # already swapped relative to base
            n.patch = node.patch
            return
    else:
        return
    old = _link_bytes(node.subs[slot]) if slot >= 0 else node.vals[-1 - slot].cid_bytes
    if old is not None and len(old) == 36:
        n.patch = (base, (*subst, (slot, old)))


def _with_sub(node: Node, i: int, new: Node | None) -> Node:
    """``node`` with subtree slot ``i`` replaced (cheap re-encoding when possible)."""
    subs = node.subs[:]
    subs[i] = new
    n = Node(node.layer, node.keys, node.vals, subs)
    _derive(node, i, n)
    return n


#: one-byte CBOR heads (major type bits | argument < 24), for the common short cases inline;
#: anything longer goes through ``mst.cbor.encode_head``
_SMALL = [bytes((i,)) for i in range(256)]


def encode_node(keys: list[bytes], vals: list[CID], links: list[CID | None]) -> bytes:
    """Wire encoding of a node (``links[0]`` is ``l``, ``links[i + 1]`` entry i's ``t``).

    Writes canonical DAG-CBOR directly (``{"e": [{"k","p","t","v"}…], "l"}``, keys already in
    canonical order) for 36-byte CIDs; anything else goes through the generic encoder. Both paths
    produce identical bytes (tested)."""
    for c in links:
        if c is not None and len(c.cid_bytes) != 36:
            return _encode_node_generic(keys, vals, links)
    n_keys = len(keys)
    parts = [b"\xa2\x61e", _SMALL[0x80 | n_keys] if n_keys < 24 else encode_head(4, n_keys)]
    append = parts.append
    small = _SMALL
    link = _LINK
    from_bytes = int.from_bytes
    prev = b""
    for i, k in enumerate(keys):
        if i:  # common prefix length with the previous key (inlined common_prefix_len)
            n = len(prev) if len(prev) < len(k) else len(k)
            x = from_bytes(prev[:n], "big") ^ from_bytes(k[:n], "big")
            p = n - ((x.bit_length() + 7) >> 3)
            suffix = k[p:]
        else:
            p = 0
            suffix = k
        ln = len(suffix)
        t = links[i + 1]
        vb = vals[i].cid_bytes
        if len(vb) != 36:
            return _encode_node_generic(keys, vals, links)
        append(
            b"".join(
                (
                    b"\xa4\x61k",
                    small[0x40 | ln] if ln < 24 else encode_head(2, ln),
                    suffix,
                    b"\x61p",
                    small[p] if p < 24 else encode_head(0, p),
                    b"\x61t\xf6" if t is None else b"\x61t" + link + t.cid_bytes,
                    b"\x61v" + link + vb,
                )
            )
        )
        prev = k
    left = links[0]
    append(b"\x61l\xf6" if left is None else b"\x61l" + link + left.cid_bytes)
    return b"".join(parts)


def _encode_node_generic(keys: list[bytes], vals: list[CID], links: list[CID | None]) -> bytes:
    entries = []
    prev = b""
    for i, k in enumerate(keys):
        p = common_prefix_len(prev, k)
        entries.append({"k": k[p:], "p": p, "t": links[i + 1], "v": vals[i]})
        prev = k
    return cbor.encode_trusted({"e": entries, "l": links[0]})


def sub_cid(sub: Sub) -> CID | None:
    if sub is None:
        return None
    if type(sub) is Node:
        return sub.cid
    return sub  # type: ignore[return-value]


def empty_node() -> Node:
    """The node of an empty tree (layer 0, no entries)."""
    return Node(0, [], [], [None])


def decode_node(data: bytes, cid: CID | None, layer: int | None) -> Node:
    """Decode and validate a node block. ``layer`` is the expected layer (``None`` for a root,
    whose layer is derived from its first key). Raises ``MSTError``/``CBORError``."""
    try:
        obj = cbor.decode_schema_checked(data)
    except CBORError as exc:
        raise MSTError("mst_node_invalid", f"node is not DAG-CBOR ({exc.reason})") from None
    if type(obj) is not dict or len(obj) != 2 or "e" not in obj or "l" not in obj:
        raise MSTError("mst_node_invalid", "node must be {e, l}")
    entries = obj["e"]
    left = obj["l"]
    if type(entries) is not list:
        raise MSTError("mst_node_invalid", "e must be an array")
    if left is not None and not _is_node_link(left):
        raise MSTError("mst_node_invalid", "l must be null or a dag-cbor CID")
    keys: list[bytes] = []
    vals: list[CID] = []
    subs: list[Sub] = [left]
    prev = b""
    heights = _HEIGHTS
    h0 = -1
    for e in entries:
        if type(e) is not dict or len(e) != 4:
            raise MSTError("mst_node_invalid", "entry must be {k, p, t, v}")
        try:
            k, p, t, v = e["k"], e["p"], e["t"], e["v"]
        except KeyError:
            raise MSTError("mst_node_invalid", "entry must be {k, p, t, v}") from None
        if type(k) is not bytes or type(p) is not int or type(v) is not CID:
            raise MSTError("mst_node_invalid", "entry field types")
        vb = v.cid_bytes
        if len(vb) != 36 or (vb[:4] != DAG_CBOR_PREFIX and vb[:4] != RAW_PREFIX):
            raise MSTError("mst_node_invalid", "v must be a blessed CID")
        if t is not None and (
            type(t) is not CID or len(t.cid_bytes) != 36 or t.cid_bytes[:4] != DAG_CBOR_PREFIX
        ):
            raise MSTError("mst_node_invalid", "t must be null or a dag-cbor CID")
        if p < 0 or p > len(prev):
            raise MSTError("mst_prefix_invalid", "prefix length out of range")
        # for 0 <= p <= len(prev): the suffix is non-empty, the shared prefix is exactly p (the
        # next byte differs) and the key exceeds the previous one iff k[:1] > prev[p:p+1]
        if k[:1] <= prev[p : p + 1]:
            if k and p < len(prev) and k[0] == prev[p]:
                raise MSTError("mst_prefix_invalid", "prefix compression is not maximal")
            raise MSTError("mst_key_order", "keys not strictly increasing")
        key = prev[:p] + k if p else k
        h = heights.get(key)
        if h is None:
            h = checked_height(key)
            if h < 0:
                raise MSTError("mst_key_invalid", "invalid MST key")
        if h != h0:
            if h0 >= 0:
                raise MSTError("mst_key_height", "keys of different heights in one node")
            h0 = h
        keys.append(key)
        vals.append(v)
        subs.append(t)
        prev = key
    if keys:
        if layer is not None and h0 != layer:
            raise MSTError("mst_key_height", f"key of height {h0} in a node at layer {layer}")
        layer = h0
    else:
        if layer is None:
            if left is not None:
                raise MSTError("mst_non_canonical", "root node with only a subtree pointer")
            layer = 0
        elif left is None:
            raise MSTError("mst_non_canonical", "empty non-root node")
    if layer == 0 and subs.count(None) != len(subs):
        raise MSTError("mst_key_height", "layer-0 node with subtree pointers")
    return Node(layer, keys, vals, subs, cid, data, True)


def _is_node_link(c: object) -> bool:
    return type(c) is CID and len(c.cid_bytes) == 36 and c.cid_bytes[:4] == DAG_CBOR_PREFIX


def load_node(store: BlockMap, cid: CID, layer: int | None) -> Node:
    """Fetch and decode the node ``cid`` from ``store``; ``MissingBlockError`` if absent."""
    data = store.get(cid)
    if data is None:
        raise MissingBlockError(cid)
    return decode_node(data, cid, layer)


def child(store: BlockMap, node: Node, i: int) -> Node | None:
    """Subtree slot ``i`` of ``node``, loading (and memoising) it from ``store`` if needed."""
    s = node.subs[i]
    if s is None or type(s) is Node:
        return s
    n = load_node(store, s, node.layer - 1)  # type: ignore[arg-type]
    node.subs[i] = n
    return n


# --- lookups ------------------------------------------------------------------------------


def node_get(store: BlockMap, node: Node, key: bytes, h: int) -> CID | None:
    """Value of ``key`` (of height ``h``) under ``node``, or ``None``."""
    n: Node | None = node
    while n is not None and n.layer >= h:
        keys = n.keys
        i = bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            return n.vals[i]
        if n.layer == h:
            return None
        n = child(store, n, i)
    return None


def iter_items(store: BlockMap, node: Node | None) -> Iterator[tuple[bytes, CID]]:
    """All ``(key, value)`` pairs under ``node`` in key order (loads every node)."""
    if node is None:
        return
    keys = node.keys
    for i in range(len(keys)):
        yield from iter_items(store, child(store, node, i))
        yield keys[i], node.vals[i]
    yield from iter_items(store, child(store, node, len(keys)))


# --- persistent updates --------------------------------------------------------------------


def _prune(n: Node) -> Node | None:
    if not n.keys and n.subs[0] is None:
        return None
    return n


def split(store: BlockMap, node: Node | None, key: bytes) -> tuple[Node | None, Node | None]:
    """Split ``node`` around ``key`` (absent from it) into the parts below and above ``key``,
    both at ``node``'s layer; empty parts are ``None``."""
    if node is None:
        return None, None
    keys = node.keys
    i = bisect_left(keys, key)
    lo, hi = split(store, child(store, node, i), key)
    layer = node.layer
    left = Node(layer, keys[:i], node.vals[:i], node.subs[:i] + [lo])
    first: list[Sub] = [hi]
    right = Node(layer, keys[i:], node.vals[i:], first + node.subs[i + 1 :])
    return _prune(left), _prune(right)


def merge(store: BlockMap, a: Node | None, b: Node | None) -> Node | None:
    """Join two adjacent subtrees of the same layer (all keys of ``a`` < all keys of ``b``)."""
    if a is None:
        return b
    if b is None:
        return a
    mid = merge(store, child(store, a, len(a.subs) - 1), child(store, b, 0))
    return Node(a.layer, a.keys + b.keys, a.vals + b.vals, a.subs[:-1] + [mid] + b.subs[1:])


def _raise_to(n: Node | None, layer: int) -> Node | None:
    while n is not None and n.layer < layer:
        n = Node(n.layer + 1, [], [], [n])
    return n


def node_put(store: BlockMap, node: Node, key: bytes, val: CID, h: int) -> Node:
    """Insert or replace ``key`` under ``node`` (``node.layer >= h``); returns the new node."""
    layer = node.layer
    keys = node.keys
    i = bisect_left(keys, key)
    if i < len(keys) and keys[i] == key:
        if node.vals[i] == val:
            return node
        vals = node.vals[:]
        vals[i] = val
        n = Node(layer, keys, vals, node.subs[:])
        _derive(node, -1 - i, n)
        return n
    if h == layer:
        lo, hi = split(store, child(store, node, i), key)
        return Node(
            layer,
            keys[:i] + [key] + keys[i:],
            node.vals[:i] + [val] + node.vals[i:],
            node.subs[:i] + [lo, hi] + node.subs[i + 1 :],
        )
    c = child(store, node, i)
    if c is None:
        c = Node(layer - 1, [], [], [None])
    return _with_sub(node, i, node_put(store, c, key, val, h))


def root_put(store: BlockMap, root: Node, key: bytes, val: CID) -> Node:
    """Insert/replace at the root, growing the tree if ``key`` is higher than the root layer."""
    h = _HEIGHTS.get(key)
    if h is None:
        h = key_height(key)
    if h <= root.layer:
        return node_put(store, root, key, val, h)
    lo, hi = split(store, None if root.is_empty else root, key)
    return Node(h, [key], [val], [_raise_to(lo, h - 1), _raise_to(hi, h - 1)])


def node_delete(store: BlockMap, node: Node, key: bytes, h: int) -> Node | None:
    """Remove ``key`` (known to be present) under ``node``; returns the new node or ``None``."""
    layer = node.layer
    keys = node.keys
    i = bisect_left(keys, key)
    if h == layer:
        if i >= len(keys) or keys[i] != key:
            raise MSTError("mst_key_not_found", "key not in tree")
        mid = merge(store, child(store, node, i), child(store, node, i + 1))
        return _prune(
            Node(
                layer,
                keys[:i] + keys[i + 1 :],
                node.vals[:i] + node.vals[i + 1 :],
                node.subs[:i] + [mid] + node.subs[i + 2 :],
            )
        )
    c = child(store, node, i)
    if c is None:
        raise MSTError("mst_key_not_found", "key not in tree")
    return _prune(_with_sub(node, i, node_delete(store, c, key, h)))


def root_delete(store: BlockMap, root: Node, key: bytes) -> Node:
    """Remove ``key`` from the tree rooted at ``root``, trimming pointer-only roots."""
    h = _HEIGHTS.get(key)
    if h is None:
        h = key_height(key)
    if h > root.layer:
        raise MSTError("mst_key_not_found", "key not in tree")
    n = node_delete(store, root, key, h)
    while n is not None and not n.keys:
        n = child(store, n, 0)
    return n if n is not None else empty_node()


def iter_new_nodes(root: Node) -> Iterator[Node]:
    """Nodes reachable from ``root`` whose blocks are not yet in the store (``stored`` False);
    stored subtrees are not entered (their descendants are stored too)."""
    stack = [root]
    while stack:
        n = stack.pop()
        if n.stored:
            continue
        yield n
        for s in n.subs:
            if type(s) is Node and not s.stored:
                stack.append(s)
