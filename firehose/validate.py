"""The relay's judgement of one message: a pure function of (message, stored account state,
signing key, now) returning a :class:`Verdict`. No I/O, no clocks, no globals.

``#commit`` (I-D §4.5 steps 1-6 plus the atproto-sync checklist), in this order:

0. account not active → *ignore* ``account_inactive``; account being resynchronised → *desync*
   ``resync_in_progress`` (the caller buffers); ``rev <= stored rev`` → *ignore*
   ``duplicate_event`` (same commit CID) or ``rev_not_increasing`` (checked before the costly
   steps: a re-delivery is common and never redistributed either way);
1. size limits: ≤200 ops (parse), ``blocks`` ≤ 2,000,000 bytes, every block ≤ 1,000,000 bytes
   (``record_too_large``);
2. CAR slice: every block hash (``bad_block_hash``), root == ``commit`` field (``car_root_mismatch``
   when the header is wrong, ``commit_cid_mismatch`` when the field is), commit block present and
   well-formed, ``did``/``rev`` equal the signed commit's, rev not more than ``max_clock_skew``
   in the future, every created/updated record block present and a DAG-CBOR map (``bad_record``);
3. MST operation inversion against ``prevData`` (the empty tree for a repo's first commit);
   a result equal to the *stored* data root but not to ``prevData`` is ``prev_data_wrong``.
   No ``prevData`` on a later commit (a sync 1.0 host) → ``missing_prev_data``, unless judged
   ``lenient`` (see ``validate_commit``): then instead of inversion each op is looked up in the
   signed tree (``ops_not_in_tree``), and the commit is accepted as ``lenient_no_prev_data``
   (likewise ``lenient_no_op_prev`` for update/delete ops without ``prev``);
4. signature with the current key → ``bad_signature`` (the caller refreshes identity once and
   retries; see ``firehose.pipeline``);
5./6. chain: ``since`` ≠ stored rev → *desync* ``since_mismatch``; ``prevData`` ≠ stored data
   root → *desync* ``prev_data_mismatch``. No stored rev (unknown account) → accepted.

``#sync``: size (``blocks`` ≤ 10,000), CAR/commit/did/rev/future checks, signature; rev ≤ stored
→ *ignore* ``sync_rollback``; accepted with ``ok`` (matches stored data, or first sight) or
``sync_reset`` (the account state is reset to the #sync's commit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import libipld

from firehose.frames import Frame, FrameError, decode_frame
from firehose.messages import (
    AccountMessage,
    CommitMessage,
    IdentityMessage,
    InfoMessage,
    Message,
    MessageError,
    SyncMessage,
    parse_frame,
)
from firehose.prune import Recording, prune_slice
from firehose.reasons import Reason
from firehose.state import AccountState
from mst import cbor
from mst.car import Car, read_car
from mst.cid import CID, DAG_CBOR_PREFIX
from mst.commit import Commit, decode_commit
from mst.crypto import PublicKey, parse_did_key
from mst.errors import (
    CARError,
    CBORError,
    CommitError,
    InversionError,
    KeyFormatError,
    MissingBlockError,
    MSTError,
)
from mst.invert import invert_ops
from mst.mst import MST
from mst.native import ACCEL
from mst.node import BlockMap, empty_node
from mst.ops import RepoOp
from mst.tid import tid_to_micros

MAX_COMMIT_BLOCKS_BYTES = 2_000_000
MAX_SYNC_BLOCKS_BYTES = 10_000
MAX_RECORD_BYTES = 1_000_000
MAX_CLOCK_SKEW_S = 300.0
EMPTY_TREE_ROOT: CID = empty_node().cid
#: Inversions this process ran by the reference (not the native path): the native path declined
#: the commit (unusual or invalid input), or is off. Valid, canonical commits never count here.
reference_inversions = 0
#: ``mst._accel.invert`` when the native path is on (see ``_invert_recorded``), else None.
_accel_invert: Callable[..., CID | None] | None = None
if ACCEL:
    from mst.accel import module as _accel_module

    _accel_invert = _accel_module().invert



def cid_text(cid: CID) -> str:
    """Canonical base32 string of a CID (what ``AccountState`` stores). Note ``str(CID)`` is
    ``"CID(b…)"`` with cbrrr, so never use ``str`` for this; libipld's encoder is ~30x faster than
    ``CID.encode()`` and gives the same text."""
    return libipld.encode_cid(cid.cid_bytes)


VerdictKind = Literal["accept", "ignore", "reject", "desync"]


@dataclass(slots=True, frozen=True)
class Verdict:
    """The outcome for one message. ``new_state`` is the account state to persist (accept, or
    the desynchronised mark); ``reason`` is a :class:`Reason` value (a metric label)."""

    kind: VerdictKind
    reason: str
    new_state: AccountState | None = None
    detail: str = ""
    #: For an accepted ``#commit``/``#sync`` judged by ``firehose.pipeline``: the outgoing body
    #: (``outgoing_body``) as canonical DAG-CBOR without ``seq``, and the offset where ``seq``
    #: belongs (``firehose.framing.encode_unsequenced``) — ready for ``PendingEvent.body_cbor``/
    #: ``seq_offset``. None otherwise (and always from ``validate_frame`` itself).
    body_cbor: bytes | None = None
    seq_offset: int | None = None
    #: For an accepted ``#commit``/``#sync`` whose CAR slice carried blocks the commit does not
    #: reference: the slice without them (``firehose.prune``), to redistribute instead of ``blocks``
    #: (counted ``strip``/``unreferenced_blocks``). None when the slice goes out as received.
    blocks: bytes | None = None
    #: For an accepted ``#commit`` judged by ``firehose.pipeline``: ``firehose.state.commit_op_changes``
    #: of its ops (for ``PendingEvent.op_changes``). None otherwise.
    op_changes: tuple[tuple[str, str], ...] | None = None

    @property
    def accepted(self) -> bool:
        return self.kind == "accept"


class _Stop(Exception):
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict


def _reject(reason: Reason, detail: str = "") -> _Stop:
    return _Stop(Verdict("reject", reason.value, None, detail))


def _gate(state: AccountState | None, did: str) -> Verdict | None:
    if state is None:
        return None
    if not state.active:
        return Verdict("ignore", Reason.ACCOUNT_INACTIVE.value, None, state.combined_status)
    if state.sync_state in ("desynchronized", "resyncing"):
        return Verdict("desync", Reason.RESYNC_IN_PROGRESS.value, None, state.sync_state)
    return None


def _open_car(blocks: bytes, commit_field: CID | None) -> tuple[Car, CID, Commit]:
    try:
        car = read_car(blocks, max_block_bytes=MAX_RECORD_BYTES, max_total_bytes=len(blocks) + 1)
    except CARError as exc:
        if exc.reason == "car_hash_mismatch":
            raise _reject(Reason.BAD_BLOCK_HASH) from None
        if exc.reason == "car_block_too_large":
            raise _reject(Reason.RECORD_TOO_LARGE) from None
        raise _reject(Reason.BAD_CAR, exc.reason) from None
    root = car.roots[0]
    if commit_field is not None and root != commit_field:
        if commit_field in car.blocks:
            raise _reject(Reason.CAR_ROOT_MISMATCH)
        raise _reject(Reason.COMMIT_CID_MISMATCH)
    block = car.blocks.get(root)
    if block is None:
        raise _reject(Reason.MISSING_COMMIT_BLOCK)
    try:
        commit = decode_commit(block)
    except CommitError as exc:
        raise _reject(Reason.BAD_COMMIT, exc.reason) from None
    return car, root, commit


def _check_commit_fields(commit: Commit, did: str, rev: str, now: float, skew: float) -> None:
    if commit.did != did:
        raise _reject(Reason.COMMIT_DID_MISMATCH)
    if commit.rev != rev:
        raise _reject(Reason.COMMIT_REV_MISMATCH)
    if tid_to_micros(rev) > (now + skew) * 1_000_000:
        raise _reject(Reason.REV_IN_FUTURE)


def _check_record(cid: CID, block: bytes) -> None:
    """A record must be a DAG-CBOR map under a dag-cbor CID; its schema is not checked (relays
    do not validate records against lexicons)."""
    if cid.cid_bytes[:4] != DAG_CBOR_PREFIX:
        raise _reject(Reason.BAD_RECORD, "record CID is not dag-cbor")
    try:
        value = cbor.decode(block)
    except CBORError as exc:
        raise _reject(Reason.BAD_RECORD, exc.reason) from None
    if type(value) is not dict:
        raise _reject(Reason.BAD_RECORD, "record is not a map")


def _check_signature(commit: Commit, signing_key: str | PublicKey) -> None:
    try:
        key = parse_did_key(signing_key) if isinstance(signing_key, str) else signing_key
    except KeyFormatError as exc:
        raise _reject(Reason.BAD_SIGNING_KEY, exc.reason) from None
    if not key.verify(commit.unsigned_bytes(), commit.sig):
        raise _reject(Reason.BAD_SIGNATURE)


def _base_state(state: AccountState | None, did: str) -> AccountState:
    return state if state is not None else AccountState(did=did)


def _lenient_reason(msg: CommitMessage, expected: CID | None) -> Reason | None:
    """Why a commit judged leniently cannot be inverted (its accept reason), or None when it can
    (then it is judged exactly as in strict mode)."""
    if expected is None:
        return Reason.LENIENT_NO_PREV_DATA
    if any(op.action != "create" and op.prev is None for op in msg.ops):
        return Reason.LENIENT_NO_OP_PREV
    return None


def _invert_recorded(used: Recording, data: CID, ops: Sequence[RepoOp]) -> CID:
    """``invert_ops`` on the slice ``used`` records, adding the blocks it read to ``used.seen``: by
    the native path (``mst._accel.invert``, which needs the plain dict and fills ``seen`` itself)
    when it accepts, else by the reference reading through the ``Recording``."""
    global reference_inversions
    if _accel_invert is not None and type(used.blocks) is dict:
        got: CID | None = _accel_invert(used.blocks, data, ops, used.seen)
        if got is not None:
            return got
    reference_inversions += 1
    return invert_ops(used, data, ops)


def _check_inversion(blocks: Recording, data: CID, msg: CommitMessage, expected: CID,
                     state: AccountState | None) -> None:
    """Step 3: the ops, inverted on the slice's partial tree (``blocks``), give back ``expected``."""
    try:
        computed = _invert_recorded(blocks, data, msg.ops)
    except MissingBlockError:
        raise _reject(Reason.MISSING_MST_BLOCK) from None
    except InversionError as exc:
        raise _reject(Reason.INVERSION_INVALID_OP, exc.reason) from None
    except MSTError as exc:
        raise _reject(Reason.BAD_MST, exc.reason) from None
    if computed != expected:
        stored_data = state.data_cid if state is not None else None
        if stored_data is not None and cid_text(computed) == stored_data:
            raise _reject(Reason.PREV_DATA_WRONG)
        raise _reject(Reason.INVERSION_MISMATCH)


def _check_ops_in_tree(blocks: BlockMap, data: CID, msg: CommitMessage) -> None:
    """What lenient mode still checks of the ops without inversion: each op's outcome is what the
    signed tree holds (a created/updated path maps to the op's CID, a deleted path is absent), read
    from the slice's partial tree (a sync-1.0 slice carries every node on those paths). It cannot
    show that the ops are *complete*: that is what inversion against ``prevData`` proves."""
    try:
        tree = MST.load(blocks, data)
        for op in msg.ops:
            if tree.get(op.path) != op.cid:
                raise _reject(Reason.OPS_NOT_IN_TREE, op.path)
    except MissingBlockError:
        raise _reject(Reason.MISSING_MST_BLOCK) from None
    except MSTError as exc:
        raise _reject(Reason.BAD_MST, exc.reason) from None


def validate_commit(
    msg: CommitMessage,
    state: AccountState | None,
    signing_key: str | PublicKey,
    now: float,
    *,
    max_clock_skew: float = MAX_CLOCK_SKEW_S,
    lenient: bool = False,
) -> Verdict:
    """Judge a ``#commit``; see the module docstring for the order of checks. ``lenient`` (sync 1.0
    hosts): a commit without ``prevData``, or with an update/delete op without ``prev``, is judged
    without step 3 and accepted with its own reason (``lenient_no_prev_data`` /
    ``lenient_no_op_prev``); every other check still applies, and step 6 whenever ``prevData`` is
    present."""
    try:
        gate = _gate(state, msg.repo)
        if gate is not None:
            return gate
        stored_rev = state.rev if state is not None else None
        if stored_rev is not None and msg.rev <= stored_rev:
            same = state is not None and state.commit_cid == cid_text(msg.commit)
            reason = Reason.DUPLICATE_EVENT if same else Reason.REV_NOT_INCREASING
            return Verdict("ignore", reason.value)
        if len(msg.blocks) > MAX_COMMIT_BLOCKS_BYTES:
            raise _reject(Reason.BLOCKS_TOO_LARGE, str(len(msg.blocks)))
        car, commit_cid, commit = _open_car(msg.blocks, msg.commit)
        _check_commit_fields(commit, msg.repo, msg.rev, now, max_clock_skew)
        for op in msg.ops:
            if op.cid is not None:
                record = car.blocks.get(op.cid)
                if record is None:
                    raise _reject(Reason.MISSING_RECORD_BLOCK)
                _check_record(op.cid, record)
        expected: CID | None  # the previous data root the commit claims (None: sync 1.0, lenient)
        if msg.prev_data is not None:
            expected = msg.prev_data
        elif msg.since is None:
            expected = EMPTY_TREE_ROOT
        elif lenient:
            expected = None
        else:
            raise _reject(Reason.MISSING_PREV_DATA)
        used = Recording(car.blocks)  # the nodes the checks read: the common slice's whole tree part
        accepted = _lenient_reason(msg, expected) if lenient else None
        if accepted is None:
            assert expected is not None
            _check_inversion(used, commit.data, msg, expected, state)
        else:
            _check_ops_in_tree(used, commit.data, msg)
        _check_signature(commit, signing_key)
        base = _base_state(state, msg.repo)
        if stored_rev is not None:
            if msg.since != stored_rev:
                return Verdict("desync", Reason.SINCE_MISMATCH.value, replace(base, sync_state="desynchronized", updated_at=now))
            if (expected is not None and state is not None and state.data_cid is not None
                    and cid_text(expected) != state.data_cid):
                return Verdict(
                    "desync", Reason.PREV_DATA_MISMATCH.value, replace(base, sync_state="desynchronized", updated_at=now)
                )
        new_state = replace(
            base, rev=msg.rev, commit_cid=cid_text(commit_cid), data_cid=cid_text(commit.data), sync_state="synced", updated_at=now
        )
        pruned = prune_slice(car, commit_cid, commit.data, [op.cid for op in msg.ops], used.seen)
        return Verdict("accept", (accepted or Reason.OK).value, new_state, blocks=None if pruned is None else pruned[0])
    except _Stop as stop:
        return stop.verdict


def validate_sync(
    msg: SyncMessage,
    state: AccountState | None,
    signing_key: str | PublicKey,
    now: float,
    *,
    max_clock_skew: float = MAX_CLOCK_SKEW_S,
) -> Verdict:
    """Judge a ``#sync``: signature and fields; rollback ignored; accepted state resets."""
    try:
        if state is not None and not state.active:
            return Verdict("ignore", Reason.ACCOUNT_INACTIVE.value, None, state.combined_status)
        if len(msg.blocks) > MAX_SYNC_BLOCKS_BYTES:
            raise _reject(Reason.BLOCKS_TOO_LARGE, str(len(msg.blocks)))
        car, commit_cid, commit = _open_car(msg.blocks, None)
        _check_commit_fields(commit, msg.did, msg.rev, now, max_clock_skew)
        _check_signature(commit, signing_key)
        if state is not None and state.rev is not None and msg.rev <= state.rev:
            return Verdict("ignore", Reason.SYNC_ROLLBACK.value)
        base = _base_state(state, msg.did)
        same = base.data_cid is None or base.data_cid == cid_text(commit.data)
        new_state = replace(
            base, rev=msg.rev, commit_cid=cid_text(commit_cid), data_cid=cid_text(commit.data), sync_state="synced", updated_at=now
        )
        pruned = prune_slice(car, commit_cid, None, ())  # a #sync carries the commit block only
        return Verdict("accept", (Reason.OK if same else Reason.SYNC_RESET).value, new_state,
                       blocks=None if pruned is None else pruned[0])
    except _Stop as stop:
        return stop.verdict


def validate_account(
    msg: AccountMessage, state: AccountState | None, now: float, *, from_account_pds: bool = True
) -> Verdict:
    """``#account`` is hop-by-hop and unsigned, so the sender is what counts: only the account's
    current PDS (``from_account_pds``, checked by the caller against a *fresh* DID document, so a
    host the account just left cannot change its status) may set it → accepted with the new
    upstream status; anyone else → reject ``wrong_host``."""
    if not from_account_pds:
        return Verdict("reject", Reason.WRONG_HOST.value)
    status = "active" if msg.active else (msg.status or "deactivated")
    base = _base_state(state, msg.did)
    return Verdict("accept", Reason.OK.value, replace(base, upstream_status=status, updated_at=now))


def validate_identity(msg: IdentityMessage, state: AccountState | None, *, from_account_pds: bool) -> Verdict:
    """``#identity`` (the caller has just re-resolved the DID): only from the account's current PDS
    (else reject ``wrong_host``: any host could otherwise announce identities for any DID), and only
    redistributed for an active account (else ignore ``account_inactive``)."""
    if not from_account_pds:
        return Verdict("reject", Reason.WRONG_HOST.value)
    if state is not None and not state.active:
        return Verdict("ignore", Reason.ACCOUNT_INACTIVE.value, None, state.combined_status)
    return Verdict("accept", Reason.OK.value)


#: ``#identity`` fields passed on (besides a verified ``handle``); anything else is dropped.
IDENTITY_FIELDS = frozenset({"did", "time"})


def identity_body(body: dict[str, Any], handle_verified: bool) -> dict[str, Any]:
    """The ``#identity`` body the relay redistributes: its lexicon fields only (no upstream
    ``seq``, nothing a host added, so an accepted ``#identity`` cannot be padded), and with
    ``handle`` only when it was verified to resolve back to the DID (a relay must not vouch for
    a handle it could not confirm)."""
    out = {k: v for k, v in body.items() if k in IDENTITY_FIELDS}
    handle = body.get("handle")
    if handle_verified and isinstance(handle, str) and handle:
        out["handle"] = handle
    return out


def validate_message(
    msg: Message, state: AccountState | None, signing_key: str | PublicKey | None, now: float, *,
    lenient: bool = False,
) -> Verdict:
    """Dispatch on the message type. ``#identity`` is accepted (the caller refreshes identity);
    ``#info`` is ignored. ``signing_key`` may be None only for messages that need none;
    ``lenient`` applies to ``#commit`` (see ``validate_commit``)."""
    if isinstance(msg, CommitMessage | SyncMessage):
        if signing_key is None:
            return Verdict("reject", Reason.BAD_SIGNING_KEY.value, None, "no signing key")
        if isinstance(msg, CommitMessage):
            return validate_commit(msg, state, signing_key, now, lenient=lenient)
        return validate_sync(msg, state, signing_key, now)
    if isinstance(msg, AccountMessage):
        return validate_account(msg, state, now)
    if isinstance(msg, IdentityMessage):
        return Verdict("accept", Reason.OK.value, None)
    assert isinstance(msg, InfoMessage)
    return Verdict("ignore", Reason.UNKNOWN_TYPE.value, None, "info")


def judge_frame(
    data: bytes | Frame, state: AccountState | None, signing_key: str | PublicKey | None, now: float, *,
    lenient: bool = False,
) -> tuple[Verdict, Frame | None]:
    """``validate_frame`` that also returns the decoded frame (None when it did not decode)."""
    frame: Frame | None = None
    try:
        frame = data if isinstance(data, Frame) else decode_frame(data)
        ignored = frame.ignored_reason
        if ignored is not None:
            return Verdict("ignore", ignored), frame
        if frame.is_error:
            return Verdict("reject", Reason.ERROR_FRAME.value, None, str(frame.error)[:64]), frame
        msg = parse_frame(frame)
    except (FrameError, MessageError) as exc:
        return Verdict("reject", exc.reason, None, exc.message[:200]), frame
    return validate_message(msg, state, signing_key, now, lenient=lenient), frame


def validate_frame(
    data: bytes | Frame, state: AccountState | None, signing_key: str | PublicKey | None, now: float, *,
    lenient: bool = False,
) -> Verdict:
    """Decode, parse and judge one raw frame. Never raises for bad input: a typed reject."""
    return judge_frame(data, state, signing_key, now, lenient=lenient)[0]


#: Fields the relay re-emits per message type: the ``com.atproto.sync.subscribeRepos`` lexicon's
#: properties, without ``seq`` (the relay assigns its own). Anything else an upstream sent is
#: dropped. The deprecated ``rebase``/``tooBig``/``blobs`` are passed on as received when they
#: have their lexicon type (consumers must ignore them; indigo compares them verbatim), within
#: bounds: ``blobs`` of at most ``MAX_BLOBS`` CIDs (or null); anything else becomes ``false`` /
#: ``[]``, so a padded deprecated field cannot enlarge the frame every consumer receives.
OUTGOING_FIELDS: dict[str, frozenset[str]] = {
    "#commit": frozenset(
        {"rebase", "tooBig", "repo", "commit", "rev", "since", "blocks", "ops", "blobs", "prevData", "time"}
    ),
    "#sync": frozenset({"did", "blocks", "rev", "time"}),
}
#: ``#repoOp`` lexicon properties.
OP_FIELDS = frozenset({"action", "path", "cid", "prev"})


def _outgoing_op(op: Any) -> Any:
    if type(op) is dict and not op.keys() <= OP_FIELDS:
        return {k: v for k, v in op.items() if k in OP_FIELDS}
    return op


#: The most blob CIDs a redistributed ``#commit`` carries in its deprecated ``blobs`` (a record
#: names a few blobs; 200 ops of them stay far below this).
MAX_BLOBS = 1000


def _deprecated_ok(out: dict[str, Any]) -> None:
    """Bound the deprecated ``#commit`` fields in place (see ``OUTGOING_FIELDS``)."""
    for flag in ("rebase", "tooBig"):
        if flag in out and type(out[flag]) is not bool:
            out[flag] = False
    blobs = out.get("blobs")
    if blobs is not None and not (type(blobs) is list and len(blobs) <= MAX_BLOBS
                                  and all(type(b) is CID for b in blobs)):
        out["blobs"] = []


def outgoing_body(t: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body the relay redistributes for an accepted ``#commit``/``#sync`` of type ``t``:
    only its lexicon fields (``OUTGOING_FIELDS``, ops reduced to ``OP_FIELDS``), no ``seq``;
    values are passed on unchanged (``blocks`` too: a caller that dropped unreferenced blocks passes
    the pruned slice in ``body``), deprecated fields within bounds. Other types: ``body`` without ``seq``."""
    fields = OUTGOING_FIELDS.get(t)
    if fields is None:
        return {k: v for k, v in body.items() if k != "seq"}
    out = {k: v for k, v in body.items() if k in fields}
    ops = out.get("ops")
    if type(ops) is list:
        out["ops"] = [_outgoing_op(op) for op in ops]
    if t == "#commit":
        _deprecated_ok(out)
    return out
