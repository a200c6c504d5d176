"""atproto signing keys: K-256 (secp256k1) and P-256 (secp256r1), ECDSA over SHA-256.

Signatures are 64-byte compact ``r || s`` with **low-S** only; DER signatures, high-S
signatures and wrong lengths never verify. K-256 uses ``coincurve`` (libsecp256k1, ~20x faster
than ``cryptography``); P-256 uses ``cryptography``. Parsed keys are cached in :data:`KEYS`, bounded
in bytes (:mod:`mst.key_cache`).

``did:key`` format: ``did:key:z`` + base58btc(multicodec varint + 33-byte compressed point), with
multicodec 0xe7 (``secp256k1-pub``) or 0x1200 (``p256-pub``). The legacy DID-document form
(``publicKeyMultibase`` without multicodec, usually uncompressed) is parsed by
:func:`parse_multibase_key`.

Errors: :class:`mst.errors.KeyFormatError` with reasons ``did_key_syntax``, ``base58_invalid``,
``key_unsupported_curve``, ``key_invalid_point``, ``key_invalid_private``.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import coincurve
from coincurve._libsecp256k1 import ffi as _ffi
from coincurve._libsecp256k1 import lib as _lib
from coincurve.context import GLOBAL_CONTEXT as _K_CTX
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from mst.errors import KeyFormatError
from mst.key_cache import KeyCache

__all__ = [
    "Curve",
    "PrivateKey",
    "PublicKey",
    "base58_decode",
    "base58_encode",
    "KEYS",
    "KEY_CACHE_BYTES",
    "KEY_ENTRY_BYTES",
    "parse_did_key",
    "parse_multibase_key",
]

Curve = Literal["k256", "p256"]

K256_MULTICODEC = b"\xe7\x01"
P256_MULTICODEC = b"\x80\x24"
K256_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_K256_HALF = (K256_ORDER // 2).to_bytes(32, "big")
_P256_HALF = (P256_ORDER // 2).to_bytes(32, "big")
_ZERO32 = bytes(32)

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def base58_encode(data: bytes) -> str:
    """base58btc (Bitcoin alphabet) encoding."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def base58_decode(s: str) -> bytes:
    """base58btc decoding; raises ``KeyFormatError('base58_invalid')``."""
    n = 0
    try:
        for c in s:
            n = n * 58 + _B58_INDEX[c]
    except KeyError:
        raise KeyFormatError("base58_invalid", "invalid base58 character") from None
    pad = len(s) - len(s.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


class PublicKey:
    """A verified-on-parse public key: ``curve`` and the 33-byte compressed point."""

    __slots__ = ("curve", "compressed", "_k", "_kobj", "_p")

    def __init__(self, curve: Curve, point: bytes) -> None:
        """Build from compressed (33 B) or uncompressed (65 B) point bytes; validates the point."""
        self.curve: Curve = curve
        self._k = None
        self._p = None
        try:
            if curve == "k256":
                k = coincurve.PublicKey(bytes(point))
                self.compressed = k.format(compressed=True)
                self._k = k.public_key
                self._kobj = k
            elif curve == "p256":
                p = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), bytes(point))
                self._p = p
                from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

                self.compressed = p.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)
            else:
                raise KeyFormatError("key_unsupported_curve", str(curve))
        except KeyFormatError:
            raise
        except (ValueError, TypeError) as exc:
            raise KeyFormatError("key_invalid_point", str(exc)[:120]) from None

    def verify(self, msg: bytes, sig: bytes) -> bool:
        """True iff ``sig`` is a 64-byte compact low-S ECDSA signature of SHA-256(``msg``)."""
        if len(sig) != 64:
            return False
        s = sig[32:]
        r = sig[:32]
        if r == _ZERO32 or s == _ZERO32:
            return False
        if self.curve == "k256":
            if s > _K256_HALF:
                return False
            raw = _ffi.new("secp256k1_ecdsa_signature *")
            if not _lib.secp256k1_ecdsa_signature_parse_compact(_K_CTX.ctx, raw, sig):
                return False
            digest = hashlib.sha256(msg).digest()
            return bool(_lib.secp256k1_ecdsa_verify(_K_CTX.ctx, raw, digest, self._k))
        if s > _P256_HALF:
            return False
        ri = int.from_bytes(r, "big")
        si = int.from_bytes(s, "big")
        if ri >= P256_ORDER:
            return False
        assert self._p is not None  # curve == "p256"
        try:
            self._p.verify(encode_dss_signature(ri, si), msg, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def did_key(self) -> str:
        """The ``did:key:z…`` form (multicodec + compressed point, base58btc)."""
        codec = K256_MULTICODEC if self.curve == "k256" else P256_MULTICODEC
        return "did:key:z" + base58_encode(codec + self.compressed)

    def multikey(self) -> str:
        """The DID-document ``Multikey`` ``publicKeyMultibase`` value (``z…``)."""
        return self.did_key()[len("did:key:") :]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and (self.curve, self.compressed) == (
            other.curve,
            other.compressed,
        )

    def __hash__(self) -> int:
        return hash((self.curve, self.compressed))

    def __repr__(self) -> str:
        return f"PublicKey({self.did_key()})"


def _decode_multikey(multibase: str) -> PublicKey:
    if not multibase.startswith("z"):
        raise KeyFormatError("did_key_syntax", "expected base58btc multibase ('z…')")
    raw = base58_decode(multibase[1:])
    if raw[:2] == K256_MULTICODEC:
        curve: Curve = "k256"
    elif raw[:2] == P256_MULTICODEC:
        curve = "p256"
    else:
        raise KeyFormatError("key_unsupported_curve", f"multicodec {raw[:2].hex()}")
    point = raw[2:]
    if len(point) != 33:
        raise KeyFormatError("key_invalid_point", "did:key must hold a 33-byte compressed point")
    return PublicKey(curve, point)


#: what one parsed key holds with its cache entry, by curve (measured with 10,000 keys of each:
#: 533 and 2,390 bytes of RSS per key; rounded up)
KEY_ENTRY_BYTES: dict[Curve, int] = {"k256": 640, "p256": 2_560}
#: the budget of :data:`KEYS`: ~52,000 K-256 or ~13,000 P-256 keys
KEY_CACHE_BYTES = 32 * 1024 * 1024
#: every parsed key of this process (``did:key`` strings and DID-document keys), bounded in bytes
KEYS: KeyCache[PublicKey] = KeyCache(KEY_CACHE_BYTES, lambda key: KEY_ENTRY_BYTES[key.curve])


def parse_did_key(s: str) -> PublicKey:
    """Parse ``did:key:z…`` (K-256 or P-256, compressed point); cached. Raises ``KeyFormatError``."""
    if not isinstance(s, str) or not s.startswith("did:key:"):
        raise KeyFormatError("did_key_syntax", "expected 'did:key:' prefix")
    found = KEYS.lookup(s)
    return found if found is not None else KEYS.store(s, _decode_multikey(s[len("did:key:") :]))


_LEGACY_TYPES: dict[str, Curve] = {
    "EcdsaSecp256r1VerificationKey2019": "p256",
    "EcdsaSecp256k1VerificationKey2019": "k256",
    "p256": "p256",
    "k256": "k256",
}


def parse_multibase_key(key_type: str, multibase: str) -> PublicKey:
    """Parse a DID-document ``publicKeyMultibase``; cached (:data:`KEYS`).

    ``key_type`` ``"Multikey"``: multicodec-prefixed compressed point (same as did:key).
    Legacy ``EcdsaSecp256r1VerificationKey2019`` / ``EcdsaSecp256k1VerificationKey2019`` (or
    ``p256``/``k256``): no multicodec, point bytes compressed or uncompressed.
    """
    found = KEYS.lookup((key_type, multibase))
    return found if found is not None else KEYS.store((key_type, multibase), _parse_multibase_key(key_type, multibase))


def _parse_multibase_key(key_type: str, multibase: str) -> PublicKey:
    if key_type == "Multikey":
        return _decode_multikey(multibase)
    curve = _LEGACY_TYPES.get(key_type)
    if curve is None:
        raise KeyFormatError("key_unsupported_curve", f"key type {key_type[:60]!r}")
    if not multibase.startswith("z"):
        raise KeyFormatError("did_key_syntax", "expected base58btc multibase ('z…')")
    raw = base58_decode(multibase[1:])
    if len(raw) not in (33, 65):
        raise KeyFormatError("key_invalid_point", f"{len(raw)}-byte key")
    return PublicKey(curve, raw)


class PrivateKey:
    """A signing key. ``sign`` returns 64-byte compact low-S signatures over SHA-256(msg)."""

    __slots__ = ("curve", "_k", "_p", "public_key", "_raw")

    def __init__(self, curve: Curve, raw: bytes) -> None:
        if len(raw) != 32:
            raise KeyFormatError("key_invalid_private", "private key must be 32 bytes")
        self.curve: Curve = curve
        self._raw = bytes(raw)
        self._k = None
        self._p = None
        try:
            if curve == "k256":
                self._k = coincurve.PrivateKey(self._raw)
                self.public_key = PublicKey("k256", self._k.public_key.format(compressed=True))
            elif curve == "p256":
                self._p = ec.derive_private_key(int.from_bytes(self._raw, "big"), ec.SECP256R1())
                from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

                pt = self._p.public_key().public_bytes(Encoding.X962, PublicFormat.CompressedPoint)
                self.public_key = PublicKey("p256", pt)
            else:
                raise KeyFormatError("key_unsupported_curve", str(curve))
        except KeyFormatError:
            raise
        except (ValueError, TypeError) as exc:
            raise KeyFormatError("key_invalid_private", str(exc)[:120]) from None

    @classmethod
    def from_bytes(cls, curve: Curve, raw: bytes) -> PrivateKey:
        """Load a 32-byte big-endian private scalar for ``curve`` (``"k256"`` or ``"p256"``)."""
        return cls(curve, raw)

    @classmethod
    def generate_k256(cls) -> PrivateKey:
        return cls("k256", coincurve.PrivateKey().secret)

    @classmethod
    def generate_p256(cls) -> PrivateKey:
        k = ec.generate_private_key(ec.SECP256R1())
        return cls("p256", k.private_numbers().private_value.to_bytes(32, "big"))

    def to_bytes(self) -> bytes:
        """The 32-byte private scalar."""
        return self._raw

    def sign(self, msg: bytes) -> bytes:
        """64-byte compact ``r || s`` (low-S) ECDSA signature of SHA-256(``msg``)."""
        if self._k is not None:
            # libsecp256k1 always produces low-S; r || s || recovery-id -> drop the last byte
            return self._k.sign_recoverable(msg)[:64]
        else:
            assert self._p is not None  # curve == "p256"
            r, s = decode_dss_signature(self._p.sign(msg, ec.ECDSA(hashes.SHA256())))
            order = P256_ORDER
        if s > order // 2:
            s = order - s
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")

    def did_key(self) -> str:
        return self.public_key.did_key()

    def __repr__(self) -> str:
        return f"PrivateKey({self.curve}, {self.public_key.did_key()})"
