"""Producer side of a simulated repository: canonical MST, signed commits, sync-1.1 CAR slices.

The simulator writes its own small producer (rather than using ``mst.repo``) so the fleet can be
built and tuned independently of the verifier under test, and so it can make deliberately broken
commits (forks that are thrown away, stripped blocks, wrong keys).

The MST is rebuilt from the sorted key list on every commit, with memoised nodes: a subtree whose
(layer, keys, values) did not change is reused without re-encoding, so a commit costs O(n) cheap
slice/hash work plus encoding of the O(depth) changed nodes only.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from dataclasses import dataclass, field
from os.path import commonprefix
from typing import Any

import cbrrr
from cbrrr import CID, DagCborTypes

from sim.ident import SigningKey, TidClock

_LAYER_CACHE: dict[bytes, int] = {}


def key_layer(key: bytes) -> int:
    """MST layer of a key: leading zero bits of SHA-256(key), counted in 2-bit chunks."""
    layer = _LAYER_CACHE.get(key)
    if layer is None:
        digest = hashlib.sha256(key).digest()
        n = int.from_bytes(digest, "big")
        zeros = 256 - n.bit_length()
        layer = zeros // 2
        if len(_LAYER_CACHE) > 2_000_000:
            _LAYER_CACHE.clear()
        _LAYER_CACHE[key] = layer
    return layer


def cid_of(data: bytes) -> CID:
    """CIDv1 dag-cbor sha-256 of already-encoded DAG-CBOR."""
    return CID.cidv1_dag_cbor_sha256_32_from(data)


class Node:
    """An encoded MST node: ``left`` subtree and entries ``(key, value, right subtree)``."""

    __slots__ = ("left", "entries", "raw", "cid")
    left: Node | None
    entries: list[tuple[bytes, CID, Node | None]]
    raw: bytes
    cid: CID

    def __init__(self, left: Node | None, entries: list[tuple[bytes, CID, Node | None]]) -> None:
        self.left = left
        self.entries = entries
        out: list[DagCborTypes] = []
        prev = b""
        for key, value, right in entries:
            p = 0
            if prev and prev[0] == key[0]:
                p = len(commonprefix((prev, key)))
            out.append({"p": p, "k": key[p:], "v": value, "t": right.cid if right else None})
            prev = key
        self.raw = cbrrr.encode_dag_cbor({"l": left.cid if left else None, "e": out})
        self.cid = cid_of(self.raw)

    def walk(self) -> list[Node]:
        """This node and every node below it."""
        nodes = [self]
        stack = [self]
        while stack:
            n = stack.pop()
            for child in ([n.left] if n.left else []) + [r for _, _, r in n.entries if r]:
                nodes.append(child)
                stack.append(child)
        return nodes


class MSTBuilder:
    """Deterministic MST over a sorted key list, with a node memo shared across versions."""

    def __init__(self) -> None:
        #: (layer, number of keys, digest of the keys and values) → node. A digest rather than the
        #: key and value tuples themselves: those make each entry as large as its range, so the memo
        #: of a repository of n keys would hold O(n²) bytes before its next clearing.
        self._memo: dict[tuple[int, int, bytes], Node] = {}

    def build(self, keys: list[bytes], values: list[CID]) -> Node:
        """Root node of the tree holding ``keys[i] -> values[i]`` (``keys`` sorted, unique)."""
        # a tree of n keys has about n/3 nodes: past n entries the memo holds mostly old versions
        if len(self._memo) > len(keys) + 64:
            self._memo.clear()
        if not keys:
            return Node(None, [])
        layers = [key_layer(k) for k in keys]
        self._vbytes = [v.cid_bytes for v in values]
        root = self._build(keys, values, layers, 0, len(keys), max(layers))
        assert root is not None  # keys is not empty
        return root

    def _build(
        self, keys: list[bytes], values: list[CID], layers: list[int], lo: int, hi: int, layer: int
    ) -> Node | None:
        if lo >= hi:
            return None
        # record paths hold no NUL byte and CIDs have one fixed length: the joins are unambiguous
        digest = hashlib.blake2b(b"\0".join(keys[lo:hi]) + b"\1" + b"".join(self._vbytes[lo:hi]), digest_size=20)
        memo_key = (layer, hi - lo, digest.digest())
        node = self._memo.get(memo_key)
        if node is not None:
            return node
        at = [i for i in range(lo, hi) if layers[i] == layer] if layer > 0 else list(range(lo, hi))
        if layer == 0:
            node = Node(None, [(keys[i], values[i], None) for i in at])
        else:
            left = self._build(keys, values, layers, lo, at[0] if at else hi, layer - 1)
            entries = []
            for j, i in enumerate(at):
                nxt = at[j + 1] if j + 1 < len(at) else hi
                entries.append((keys[i], values[i], self._build(keys, values, layers, i + 1, nxt, layer - 1)))
            node = Node(left, entries)
        self._memo[memo_key] = node
        return node


def path_nodes(root: Node, key: bytes) -> list[Node]:
    """Nodes visited looking ``key`` up from ``root`` (whether or not the key is present)."""
    out = []
    node: Node | None = root
    while node is not None:
        out.append(node)
        nxt = node.left
        for k, _, right in node.entries:
            if k == key:
                return out
            if k < key:
                nxt = right
            else:
                break
        node = nxt
    return out


def write_car(root: CID, blocks: list[tuple[CID, bytes]]) -> bytes:
    """CARv1 with a single root: varint-prefixed header then ``varint(len) cid data`` sections."""
    header = cbrrr.encode_dag_cbor({"version": 1, "roots": [root]})
    parts = [_varint(len(header)), header]
    seen: set[bytes] = set()
    for cid, data in blocks:
        cid_bytes = bytes(cid)
        if cid_bytes in seen:
            continue
        seen.add(cid_bytes)
        parts.append(_varint(len(cid_bytes) + len(data)))
        parts.append(cid_bytes)
        parts.append(data)
    return b"".join(parts)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@dataclass(slots=True)
class Write:
    """One requested mutation: ``record`` is None for deletes."""

    action: str
    collection: str
    rkey: str
    record: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return f"{self.collection}/{self.rkey}"


@dataclass(slots=True)
class Op:
    """A repo operation as it appears in a ``#commit`` (``cid``/``prev`` are record CIDs)."""

    action: str
    path: str
    cid: CID | None
    prev: CID | None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"action": self.action, "path": self.path, "cid": self.cid}
        if self.prev is not None:
            out["prev"] = self.prev
        return out


@dataclass(slots=True)
class CommitResult:
    """A produced commit: ``car`` is the sync-1.1 slice whose first root is ``commit_cid``."""

    commit_cid: CID
    commit: dict[str, Any]
    commit_bytes: bytes
    rev: str
    since: str | None
    prev_data: CID | None
    data: CID
    ops: list[Op]
    car: bytes
    blocks: list[tuple[CID, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class _State:
    keys: list[bytes]
    values: list[CID]
    records: dict[str, tuple[CID, bytes]]
    root: Node
    rev: str | None
    head: CID | None
    head_bytes: bytes | None


class SimRepo:
    """A simulated account repository that produces signed commits with sync-1.1 CAR slices."""

    def __init__(self, did: str, key: SigningKey, clock: TidClock | None = None) -> None:
        self.did = did
        self.key = key
        self.clock = clock or TidClock()
        self._builder = MSTBuilder()
        self._s = _State([], [], {}, Node(None, []), None, None, None)
        #: (state before, state after) the last commit, for :meth:`rollback`
        self._last: tuple[_State, _State] | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def rev(self) -> str | None:
        return self._s.rev

    @property
    def head(self) -> CID | None:
        return self._s.head

    @property
    def data_root(self) -> CID:
        return self._s.root.cid

    def records(self) -> dict[str, CID]:
        """Current ``path -> record CID`` mapping."""
        return {p: c for p, (c, _) in self._s.records.items()}

    def record_paths(self) -> list[str]:
        return [k.decode() for k in self._s.keys]

    def snapshot(self) -> _State:
        """Opaque state to hand back to :meth:`restore` (forks for fault injection)."""
        s = self._s
        return _State(list(s.keys), list(s.values), dict(s.records), s.root, s.rev, s.head, s.head_bytes)

    def restore(self, state: _State) -> None:
        self._s = state

    def rollback(self) -> bool:
        """Go back to the state before the latest commit (a host restored from a backup that
        predates it). False, and nothing changed, when that is not possible: the latest commit was
        undone already (or by :meth:`restore`), or it was the repository's first."""
        last = self._last
        if last is None or last[1] is not self._s or last[0].rev is None:
            return False
        self._s, self._last = last[0], None
        return True

    # -- producing ---------------------------------------------------------------------------
    def apply_writes(self, writes: list[Write], *, sign_with: SigningKey | None = None) -> CommitResult:
        """Apply ``writes`` and sign a new commit; raises ``ValueError`` on an impossible write."""
        s = self._s
        keys, values, records = list(s.keys), list(s.values), dict(s.records)
        ops: list[Op] = []
        new_blocks: list[tuple[CID, bytes]] = []
        for w in writes:
            path = w.path
            kb = path.encode()
            i = bisect_left(keys, kb)
            present = i < len(keys) and keys[i] == kb
            if w.action == "delete":
                if not present:
                    raise ValueError(f"delete of missing record {path}")
                ops.append(Op("delete", path, None, values[i]))
                del keys[i], values[i]
                del records[path]
                continue
            raw = cbrrr.encode_dag_cbor(w.record)
            cid = cid_of(raw)
            if w.action == "create":
                if present:
                    raise ValueError(f"create of existing record {path}")
                keys.insert(i, kb)
                values.insert(i, cid)
                ops.append(Op("create", path, cid, None))
            elif w.action == "update":
                if not present:
                    raise ValueError(f"update of missing record {path}")
                ops.append(Op("update", path, cid, values[i]))
                values[i] = cid
            else:
                raise ValueError(f"unknown action {w.action!r}")
            records[path] = (cid, raw)
            new_blocks.append((cid, raw))
        root = self._builder.build(keys, values)
        rev = self.clock.next()
        if s.rev is not None and rev <= s.rev:
            raise ValueError("clock went backwards")
        commit: dict[str, DagCborTypes] = {
            "did": self.did, "version": 3, "data": root.cid, "rev": rev, "prev": None
        }
        commit["sig"] = (sign_with or self.key).sign(cbrrr.encode_dag_cbor(commit))
        commit_bytes = cbrrr.encode_dag_cbor(commit)
        commit_cid = cid_of(commit_bytes)
        # Proof blocks: paths to every touched key and to its neighbours in the new tree,
        # which covers every new node and whatever an inversion (re-insert / re-delete) reads.
        seen: dict[bytes, Node] = {}
        for op in ops:
            kb = op.path.encode()
            i = bisect_left(keys, kb)
            probes = [kb]
            if i > 0:
                probes.append(keys[i - 1])
            j = i + 1 if (i < len(keys) and keys[i] == kb) else i
            if j < len(keys):
                probes.append(keys[j])
            for probe in probes:
                for n in path_nodes(root, probe):
                    seen.setdefault(bytes(n.cid), n)
        if not ops:
            seen[bytes(root.cid)] = root
        blocks = [(commit_cid, commit_bytes)] + [(n.cid, n.raw) for n in seen.values()] + new_blocks
        result = CommitResult(
            commit_cid=commit_cid,
            commit=commit,
            commit_bytes=commit_bytes,
            rev=rev,
            since=s.rev,
            prev_data=s.root.cid if s.rev is not None else None,
            data=root.cid,
            ops=ops,
            car=write_car(commit_cid, blocks),
            blocks=blocks,
        )
        self._s = _State(keys, values, records, root, rev, commit_cid, commit_bytes)
        self._last = (s, self._s)
        return result

    def resign(self) -> CommitResult:
        """An empty commit: same data, new rev and signature (used for ``#sync`` after migration)."""
        return self.apply_writes([])

    def export_car(self) -> bytes:
        """The whole repository as a CAR: commit, every MST node, every record."""
        s = self._s
        if s.head is None or s.head_bytes is None:
            raise ValueError("repository has no commit yet")
        blocks = [(s.head, s.head_bytes)] + [(n.cid, n.raw) for n in s.root.walk()]
        blocks += list(s.records.values())
        return write_car(s.head, blocks)

    def commit_car(self) -> bytes:
        """CAR holding just the current commit block (the ``#sync`` event payload)."""
        s = self._s
        if s.head is None or s.head_bytes is None:
            raise ValueError("repository has no commit yet")
        return write_car(s.head, [(s.head, s.head_bytes)])
