"""Signed repository commits (version 3): ``{did, version, data, rev, prev, sig}``.

The signature is over SHA-256 of the DAG-CBOR encoding of the commit without ``sig``; the
commit CID is the dag-cbor CID of the signed encoding. Decoding is strict: exactly the six
fields, ``version == 3``, valid DID and TID ``rev``, dag-cbor ``data``/``prev`` links, ``prev``
present (may be null). Errors are :class:`mst.errors.CommitError` with reasons
``commit_invalid_cbor``, ``commit_schema``, ``commit_version``, ``commit_invalid_did``,
``commit_invalid_rev``, ``commit_invalid_link``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mst import cbor
from mst.cid import CID, DAG_CBOR_PREFIX, cid_for_cbor
from mst.crypto import PrivateKey, PublicKey, parse_did_key
from mst.errors import CBORError, CommitError
from mst.syntax import is_valid_did, is_valid_tid

__all__ = ["Commit", "decode_commit", "sign_commit", "verify_commit_sig"]

_FIELDS = frozenset({"did", "version", "data", "rev", "prev", "sig"})


@dataclass(frozen=True, slots=True)
class Commit:
    """A (signed) commit object."""

    did: str
    version: int
    data: CID
    rev: str
    prev: CID | None
    sig: bytes
    #: The signed bytes, when ``decode_commit`` took them from the block itself (its native path);
    #: never set otherwise. Not an argument, not compared, not copied by ``dataclasses.replace``.
    signed: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def unsigned_dict(self) -> dict[str, object]:
        return {
            "did": self.did,
            "version": self.version,
            "data": self.data,
            "rev": self.rev,
            "prev": self.prev,
        }

    def unsigned_bytes(self) -> bytes:
        """The bytes that are signed: DAG-CBOR of the commit without ``sig``."""
        signed = self.signed
        return signed if signed is not None else cbor.encode_trusted(self.unsigned_dict())

    def encode(self) -> bytes:
        """DAG-CBOR of the signed commit (its block)."""
        d = self.unsigned_dict()
        d["sig"] = self.sig
        return cbor.encode_trusted(d)

    @property
    def cid(self) -> CID:
        return cid_for_cbor(self.encode())


def _is_node_link(v: object) -> bool:
    return type(v) is CID and len(v.cid_bytes) == 36 and v.cid_bytes[:4] == DAG_CBOR_PREFIX


def commit_from_obj(obj: object) -> Commit:
    """Validate an already-decoded commit object; raises ``CommitError``."""
    if type(obj) is not dict or obj.keys() != _FIELDS:
        raise CommitError("commit_schema", "commit must have exactly did, version, data, rev, prev, sig")
    did, version, data, rev, prev, sig = (
        obj["did"],
        obj["version"],
        obj["data"],
        obj["rev"],
        obj["prev"],
        obj["sig"],
    )
    if type(version) is not int or version != 3:
        raise CommitError("commit_version", f"unsupported commit version {version!r}")
    if type(did) is not str or not is_valid_did(did):
        raise CommitError("commit_invalid_did", "commit did is not a valid DID")
    if type(rev) is not str or not is_valid_tid(rev):
        raise CommitError("commit_invalid_rev", "commit rev is not a TID")
    if not _is_node_link(data) or (prev is not None and not _is_node_link(prev)):
        raise CommitError("commit_invalid_link", "data/prev must be dag-cbor CIDs")
    if type(sig) is not bytes:
        raise CommitError("commit_schema", "sig must be bytes")
    return Commit(did, version, data, rev, prev, sig)


def decode_commit(data: bytes) -> Commit:
    """Decode and validate a commit block; raises ``CommitError``."""
    if _accel_commit is not None:
        fields = _accel_commit(data)  # the native path: a canonical, valid commit, or None
        if fields is not None:
            did, version, link, rev, prev, sig, signed = fields
            commit = Commit(did, version, link, rev, prev, sig)
            object.__setattr__(commit, "signed", signed)
            return commit
    return decode_commit_reference(data)


def decode_commit_reference(data: bytes) -> Commit:
    """:func:`decode_commit` without the native path (the reference it falls back to)."""
    try:
        obj = cbor.decode_schema_checked(data)  # version and links are checked below
    except CBORError as exc:
        raise CommitError("commit_invalid_cbor", exc.reason) from None
    return commit_from_obj(obj)


def sign_commit(
    did: str, data: CID, rev: str, prev: CID | None, key: PrivateKey
) -> tuple[Commit, bytes, CID]:
    """Create and sign a version-3 commit; returns ``(commit, block_bytes, commit_cid)``."""
    unsigned = Commit(did, 3, data, rev, prev, b"")
    commit = Commit(did, 3, data, rev, prev, key.sign(unsigned.unsigned_bytes()))
    block = commit.encode()
    return commit, block, cid_for_cbor(block)


def verify_commit_sig(commit: Commit, public_key: PublicKey | str) -> bool:
    """True iff ``commit.sig`` is a valid low-S signature by ``public_key`` (object or did:key)."""
    pk = parse_did_key(public_key) if isinstance(public_key, str) else public_key
    return pk.verify(commit.unsigned_bytes(), commit.sig)


#: mst._accel.commit (when mst.native.ACCEL): the fields of a canonical, valid commit block, or
#: None (then ``decode_commit_reference`` decodes it or raises the error with its reason).
_accel_commit: Callable[[bytes], tuple[str, int, CID, str, CID | None, bytes, bytes] | None] | None = None
# (At the end of the module, as in mst.cbor: mst.native imports modules that import this one.)
from mst.native import ACCEL  # noqa: E402

if ACCEL:
    from mst.accel import module as _accel_module

    _accel_commit = _accel_module().commit
