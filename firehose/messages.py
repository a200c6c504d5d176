"""Typed models of the ``com.atproto.sync.subscribeRepos`` messages, parsed strictly.

``parse_message(t, body)`` checks required fields, types and syntax (DID, TID, datetime,
handle, repo paths, CIDs), the 200-op limit and the no-duplicate-path rule, and raises
:class:`MessageError` with a :class:`firehose.reasons.Reason`. Unknown fields are tolerated.

Deprecated ``#commit`` fields are ignored as the I-D requires ("consumers MUST ignore"):
``tooBig``, ``rebase`` and ``blobs`` (real PDSes send ``blobs: null``, as in the recorded
scenarios) may be absent or of any type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from firehose.frames import Frame
from firehose.reasons import Reason
from mst.cid import CID
from mst.errors import ReasonError
from mst.ops import RepoOp
from mst.syntax import (
    is_valid_datetime,
    is_valid_did,
    is_valid_handle,
    is_valid_nsid,
    is_valid_record_key,
    is_valid_tid,
)

# DIDs and collections repeat across events: memoise their (pure) syntax checks.
_did_ok = lru_cache(maxsize=1 << 16)(is_valid_did)
_collection_ok = lru_cache(maxsize=1 << 12)(is_valid_nsid)


def _path_ok(path: str) -> bool:
    collection, sep, rkey = path.partition("/")
    return bool(sep) and _collection_ok(collection) and is_valid_record_key(rkey)


MAX_OPS = 200
SEQ_LIMIT = 2**53
_ACTIONS = frozenset({"create", "update", "delete"})


class MessageError(ReasonError):
    """A message body that does not satisfy its schema; ``reason`` is a Reason value."""


@dataclass(slots=True, frozen=True)
class CommitMessage:
    seq: int
    repo: str
    rev: str
    since: str | None
    commit: CID
    blocks: bytes
    ops: tuple[RepoOp, ...]
    prev_data: CID | None
    time: str

    @property
    def did(self) -> str:
        return self.repo


@dataclass(slots=True, frozen=True)
class SyncMessage:
    seq: int
    did: str
    rev: str
    blocks: bytes
    time: str


@dataclass(slots=True, frozen=True)
class IdentityMessage:
    seq: int
    did: str
    time: str
    handle: str | None


@dataclass(slots=True, frozen=True)
class AccountMessage:
    seq: int
    did: str
    time: str
    active: bool
    status: str | None


@dataclass(slots=True, frozen=True)
class InfoMessage:
    name: str
    message: str | None


Message = CommitMessage | SyncMessage | IdentityMessage | AccountMessage | InfoMessage


def _req(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise MessageError(Reason.MISSING_FIELD, key)
    return body[key]


def _str(body: dict[str, Any], key: str) -> str:
    v = _req(body, key)
    if type(v) is not str:
        raise MessageError(Reason.BAD_FIELD_TYPE, key)
    return v


def _seq(body: dict[str, Any]) -> int:
    v = _req(body, "seq")
    if type(v) is not int or not 0 < v < SEQ_LIMIT:
        raise MessageError(Reason.BAD_SEQ)
    return v


def _did(body: dict[str, Any], key: str = "did") -> str:
    v = _str(body, key)
    if not _did_ok(v):
        raise MessageError(Reason.BAD_DID, key)
    return v


def _time(body: dict[str, Any]) -> str:
    v = _str(body, "time")
    if not is_valid_datetime(v):
        raise MessageError(Reason.BAD_DATETIME)
    return v


def _rev(body: dict[str, Any]) -> str:
    v = _str(body, "rev")
    if not is_valid_tid(v):
        raise MessageError(Reason.BAD_REV)
    return v


def _bytes(body: dict[str, Any], key: str) -> bytes:
    v = _req(body, key)
    if type(v) is not bytes:
        raise MessageError(Reason.BAD_FIELD_TYPE, key)
    return v


def _op(raw: Any) -> RepoOp:
    if type(raw) is not dict:
        raise MessageError(Reason.BAD_OP)
    action = raw.get("action")
    if action not in _ACTIONS:
        raise MessageError(Reason.BAD_OP_ACTION)
    path = raw.get("path")
    if type(path) is not str or not _path_ok(path):
        raise MessageError(Reason.BAD_OP_PATH)
    if "cid" not in raw:
        raise MessageError(Reason.MISSING_FIELD, "ops.cid")
    cid, prev = raw["cid"], raw.get("prev")
    if (action == "delete") != (cid is None) or (cid is not None and not isinstance(cid, CID)):
        raise MessageError(Reason.BAD_OP_CID, action)
    if prev is not None and not isinstance(prev, CID):
        raise MessageError(Reason.BAD_OP_CID, "prev")
    return RepoOp(action, path, cid, prev)


def parse_commit(body: dict[str, Any]) -> CommitMessage:
    seq = _seq(body)
    repo = _did(body, "repo")
    rev = _rev(body)
    if "since" not in body:
        raise MessageError(Reason.MISSING_FIELD, "since")
    since = body["since"]
    if since is not None and (type(since) is not str or not is_valid_tid(since)):
        raise MessageError(Reason.BAD_SINCE)
    commit = _req(body, "commit")
    if not isinstance(commit, CID):
        raise MessageError(Reason.BAD_FIELD_TYPE, "commit")
    blocks = _bytes(body, "blocks")
    raw_ops = _req(body, "ops")
    if type(raw_ops) is not list:
        raise MessageError(Reason.BAD_FIELD_TYPE, "ops")
    if len(raw_ops) > MAX_OPS:
        raise MessageError(Reason.TOO_MANY_OPS, str(len(raw_ops)))
    ops = tuple(_op(o) for o in raw_ops)
    if len({o.path for o in ops}) != len(ops):
        raise MessageError(Reason.DUPLICATE_OP_PATH)
    prev_data = body.get("prevData")
    if prev_data is not None and not isinstance(prev_data, CID):
        raise MessageError(Reason.BAD_FIELD_TYPE, "prevData")
    return CommitMessage(seq, repo, rev, since, commit, blocks, ops, prev_data, _time(body))


def parse_sync(body: dict[str, Any]) -> SyncMessage:
    return SyncMessage(_seq(body), _did(body), _rev(body), _bytes(body, "blocks"), _time(body))


def parse_identity(body: dict[str, Any]) -> IdentityMessage:
    handle = body.get("handle")
    if handle is not None and (type(handle) is not str or not is_valid_handle(handle)):
        raise MessageError(Reason.BAD_HANDLE)
    return IdentityMessage(_seq(body), _did(body), _time(body), handle)


def parse_account(body: dict[str, Any]) -> AccountMessage:
    active = _req(body, "active")
    if type(active) is not bool:
        raise MessageError(Reason.BAD_FIELD_TYPE, "active")
    status = body.get("status")
    if status is not None and type(status) is not str:
        raise MessageError(Reason.BAD_FIELD_TYPE, "status")
    return AccountMessage(_seq(body), _did(body), _time(body), active, status)


def parse_info(body: dict[str, Any]) -> InfoMessage:
    message = body.get("message")
    return InfoMessage(_str(body, "name"), message if type(message) is str else None)


_PARSERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "#commit": parse_commit,
    "#sync": parse_sync,
    "#identity": parse_identity,
    "#account": parse_account,
    "#info": parse_info,
}


def parse_message(t: str, body: dict[str, Any]) -> Message:
    """Parse a message body of type ``t``; raises :class:`MessageError` (``unknown_type`` too)."""
    parser = _PARSERS.get(t)
    if parser is None:
        raise MessageError(Reason.UNKNOWN_TYPE, t[:40])
    return parser(body)


def parse_frame(frame: Frame) -> Message:
    """Parse a decoded message frame (``op: 1``)."""
    if frame.t is None:
        raise MessageError(Reason.ERROR_FRAME)
    return parse_message(frame.t, frame.body)
