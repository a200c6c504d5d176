"""Producer side of a repository: build a repo, apply writes, emit signed commits with the
sync-1.1 CAR slice, export the whole repo as a CAR. Used by the simulator, tests and tools.

The whole tree is kept in memory as :class:`mst.node.Node` objects (each node's encoding and
CID is computed once), records as ``path -> (cid, bytes)``; nothing is re-encoded unless it
changed. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from mst import cbor
from mst.car import write_car
from mst.cid import CID, cid_for_cbor
from mst.commit import Commit, sign_commit
from mst.crypto import PrivateKey
from mst.errors import RepoError
from mst.node import Node, child, empty_node, iter_new_nodes, key_height, node_get, root_delete, root_put
from mst.ops import RepoOp
from mst.proof import covering_nodes
from mst.syntax import is_valid_nsid, is_valid_record_key
from mst.tid import TidClock

__all__ = ["CommitResult", "Repo", "Write"]

_NO_STORE: dict[CID, bytes] = {}


@dataclass(frozen=True, slots=True)
class Write:
    """One record write: ``record`` is the record value (required unless ``delete``)."""

    action: Literal["create", "update", "delete"]
    collection: str
    rkey: str
    record: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        return f"{self.collection}/{self.rkey}"


@dataclass(frozen=True, slots=True)
class CommitResult:
    """A new commit and everything a ``#commit`` event needs.

    ``car`` is the sync-1.1 slice: header root = ``commit_cid``; blocks = the commit, the
    created/updated records, every MST node that is new in this revision, and the covering-proof
    nodes of every op path (enough to invert ``ops`` back to ``prev_data``).
    ``since``/``prev_data`` are ``None`` for the first commit.
    """

    commit_cid: CID
    commit: Commit
    rev: str
    since: str | None
    prev_data: CID | None
    data: CID
    ops: list[RepoOp]
    car: bytes
    blocks: dict[CID, bytes] = field(repr=False, default_factory=dict)


class Repo:
    """An in-memory repository owned by ``did`` and signed with ``key``."""

    def __init__(self, did: str, key: PrivateKey, clock: TidClock | None = None) -> None:
        self.did = did
        self.key = key
        self.clock = clock or TidClock()
        self._root: Node = empty_node()
        self._records: dict[str, tuple[CID, bytes]] = {}
        self.commit: Commit | None = None
        self.head: CID | None = None
        self._commit_block = b""
        self.genesis: CommitResult | None = None

    @classmethod
    def create(cls, did: str, key: PrivateKey, clock: TidClock | None = None) -> Repo:
        """A new repo with its first (empty-tree) commit signed; see ``.genesis``."""
        repo = cls(did, key, clock)
        repo.genesis = repo.apply_writes([])
        return repo

    # --- state ---------------------------------------------------------------------------

    @property
    def rev(self) -> str:
        assert self.commit is not None
        return self.commit.rev

    @property
    def data_root(self) -> CID:
        return self._root.cid

    def records(self) -> dict[str, CID]:
        """Current ``path -> record CID`` mapping."""
        return {p: c for p, (c, _) in self._records.items()}

    def get_record(self, path: str) -> dict[str, Any] | None:
        entry = self._records.get(path)
        return None if entry is None else cbor.decode(entry[1])  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._records)

    # --- writes ----------------------------------------------------------------------------

    def apply_writes(self, writes: list[Write], *, sign_with: PrivateKey | None = None) -> CommitResult:
        """Apply ``writes`` atomically as one signed commit.

        ``sign_with`` signs this one commit with another key (fault injection: a commit that
        must fail signature verification); the repo's state still advances.

        Raises ``RepoError`` with reason ``write_invalid_path``, ``write_record_exists``
        (create of an existing path), ``write_record_missing`` (update/delete of an absent
        path), ``write_missing_record`` or ``write_duplicate_path``; the repo is unchanged then.
        """
        root = self._root
        ops: list[RepoOp] = []
        new_records: dict[str, tuple[CID, bytes]] = {}
        deleted: set[str] = set()
        seen: set[str] = set()
        for w in writes:
            path = w.path
            if not is_valid_nsid(w.collection) or not is_valid_record_key(w.rkey):
                raise RepoError("write_invalid_path", path[:100])
            if path in seen:
                raise RepoError("write_duplicate_path", path[:100])
            seen.add(path)
            key = path.encode()
            current = node_get(_NO_STORE, root, key, key_height(key))
            if w.action == "delete":
                if current is None:
                    raise RepoError("write_record_missing", path)
                root = root_delete(_NO_STORE, root, key)
                ops.append(RepoOp("delete", path, None, current))
                deleted.add(path)
                continue
            if w.record is None:
                raise RepoError("write_missing_record", path)
            if w.action == "create" and current is not None:
                raise RepoError("write_record_exists", path)
            if w.action == "update" and current is None:
                raise RepoError("write_record_missing", path)
            if w.action not in ("create", "update"):
                raise RepoError("write_invalid_action", str(w.action)[:20])
            block = cbor.encode(w.record)
            cid = cid_for_cbor(block)
            new_records[path] = (cid, block)
            root = root_put(_NO_STORE, root, key, cid)
            ops.append(RepoOp(w.action, path, cid, current))

        prev_commit = self.commit
        rev = self.clock.next() if prev_commit is None else self.clock.next_after(prev_commit.rev)
        commit, commit_block, commit_cid = sign_commit(self.did, root.cid, rev, None, sign_with or self.key)

        blocks: dict[CID, bytes] = {commit_cid: commit_block}
        for n in iter_new_nodes(root):
            blocks[n.cid] = n.encode()
        if ops:
            for cid, n in covering_nodes(_NO_STORE, root, (op.path.encode() for op in ops)).items():
                blocks[cid] = n.encode()
        for cid, block in new_records.values():
            blocks[cid] = block
        for n in iter_new_nodes(root):
            n.stored = True

        result = CommitResult(
            commit_cid=commit_cid,
            commit=commit,
            rev=rev,
            since=None if prev_commit is None else prev_commit.rev,
            prev_data=None if prev_commit is None else prev_commit.data,
            data=root.cid,
            ops=ops,
            car=write_car([commit_cid], blocks.items()),
            blocks=blocks,
        )
        # commit the new state
        self._root = root
        for path in deleted:
            del self._records[path]
        self._records.update(new_records)
        self.commit = commit
        self.head = commit_cid
        self._commit_block = commit_block
        return result

    def resign(self) -> CommitResult:
        """A new commit over the unchanged tree (e.g. after a key rotation); no ops."""
        return self.apply_writes([])

    # --- export --------------------------------------------------------------------------

    def _walk_blocks(self, node: Node) -> Iterator[tuple[CID, bytes]]:
        yield node.cid, node.encode()
        for i in range(len(node.keys) + 1):
            c = child(_NO_STORE, node, i)
            if c is not None:
                yield from self._walk_blocks(c)
            if i < len(node.keys):
                cid, block = self._records[node.keys[i].decode()]
                yield cid, block

    def export_car(self) -> bytes:
        """The full repository as a CAR (commit first, then MST nodes and records in
        pre-order, the streamable ordering)."""
        assert self.head is not None
        return write_car([self.head], [(self.head, self._commit_block), *self._walk_blocks(self._root)])

    def blocks(self) -> dict[CID, bytes]:
        """Every block of the current revision (commit, MST nodes, records)."""
        assert self.head is not None
        out = {self.head: self._commit_block}
        out.update(self._walk_blocks(self._root))
        return out
