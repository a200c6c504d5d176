"""CIDs: the blessed atproto form only (CIDv1, dag-cbor 0x71 or raw 0x55, sha-256, 32 bytes).

``CID`` is ``cbrrr.CID`` everywhere in the project; ``str(cid)`` is not defined by cbrrr, use
``cid.encode()`` (base32 ``b…``) or :func:`cid_str`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable

from cbrrr import CID

from mst.errors import CIDError

__all__ = [
    "CID",
    "DAG_CBOR_PREFIX",
    "RAW_PREFIX",
    "cid_for_cbor",
    "cid_for_raw",
    "cid_from_bytes",
    "cid_str",
    "is_blessed",
    "parse_cid",
    "sha256_digest",
    "sha256_small",
]

DAG_CBOR_PREFIX = b"\x01\x71\x12\x20"
RAW_PREFIX = b"\x01\x55\x12\x20"
_BLESSED_PREFIXES = (DAG_CBOR_PREFIX, RAW_PREFIX)
_sha256 = hashlib.sha256
try:  # CPython's own SHA-256: ~1 us less per call than OpenSSL 3's (whose setup dominates small inputs)
    from _sha256 import sha256 as _builtin_sha256  # type: ignore[import-not-found]  # Python <= 3.11
except ImportError:  # pragma: no cover - depends on the interpreter build
    try:
        from _sha2 import sha256 as _builtin_sha256  # type: ignore[import-not-found]  # Python >= 3.12
    except ImportError:
        _builtin_sha256 = hashlib.sha256
#: SHA-256 constructor that is cheapest for inputs under ``SMALL_HASH_BYTES`` (same interface as hashlib's).
sha256_small: Callable[[bytes], hashlib._Hash] = _builtin_sha256
# below this size the builtin implementation is faster; above it OpenSSL's faster compression wins
SMALL_HASH_BYTES = 768


def sha256_digest(data: bytes) -> bytes:
    """SHA-256 of ``data`` by whichever implementation is cheaper for its size."""
    if len(data) < SMALL_HASH_BYTES:
        return sha256_small(data).digest()
    return _sha256(data).digest()


def cid_for_cbor(data: bytes) -> CID:
    """The dag-cbor CID (CIDv1, sha-256) of already-encoded DAG-CBOR bytes."""
    if len(data) < SMALL_HASH_BYTES:
        return CID(DAG_CBOR_PREFIX + sha256_small(data).digest())
    return CID(DAG_CBOR_PREFIX + _sha256(data).digest())


def cid_for_raw(data: bytes) -> CID:
    """The raw-codec CID (CIDv1, sha-256) of arbitrary bytes (e.g. a blob)."""
    return CID(RAW_PREFIX + sha256_digest(data))


def is_blessed(cid: CID) -> bool:
    """True if ``cid`` is CIDv1 with codec dag-cbor or raw and a 32-byte sha-256 multihash."""
    b = cid.cid_bytes
    return len(b) == 36 and b[:4] in _BLESSED_PREFIXES


def cid_from_bytes(raw: bytes) -> CID:
    """Binary CID -> ``CID``; raises ``CIDError('cid_not_blessed')`` unless it is the blessed form."""
    raw = bytes(raw)
    if len(raw) == 36 and raw[:4] in _BLESSED_PREFIXES:
        return CID(raw)
    raise CIDError("cid_not_blessed", f"unsupported binary CID {raw[:8].hex()}…")


def cid_str(cid: CID) -> str:
    """The canonical string form (multibase base32 lower, ``b…``)."""
    return cid.encode()


_B32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")


def parse_cid(s: str) -> CID:
    """Parse the canonical string form of a blessed CID (``b`` + base32 lower, no padding).

    Raises ``CIDError`` with reason ``cid_syntax`` (not base32 multibase, bad characters or
    length) or ``cid_not_blessed`` (decodes, but is not CIDv1 dag-cbor/raw sha-256).
    """
    if not isinstance(s, str) or len(s) < 2 or s[0] != "b":
        raise CIDError("cid_syntax", "CID string must be multibase base32 ('b…')")
    body = s[1:]
    if not _B32_ALPHABET.issuperset(body):
        raise CIDError("cid_syntax", "invalid base32 character in CID")
    try:
        raw = base64.b32decode(body.upper() + "=" * ((-len(body)) % 8))
    except (binascii.Error, ValueError) as exc:
        raise CIDError("cid_syntax", str(exc)) from None
    cid = cid_from_bytes(raw)
    if cid.encode() != s:  # non-canonical trailing bits
        raise CIDError("cid_syntax", "non-canonical base32 encoding")
    return cid
