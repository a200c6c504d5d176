"""Identities of simulated accounts: signing keys, ``did:plc`` ids, TIDs and DID documents.

Self-contained (coincurve for K-256, ``cryptography`` for P-256) so the simulator does not depend
on the verifier it is meant to exercise. Signatures are 64-byte compact ``r||s`` with low-S over
SHA-256, as the atproto cryptography spec requires.
"""

from __future__ import annotations

import hashlib
import random
import time
from base64 import b32encode
from typing import Any, Literal

import coincurve
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

Curve = Literal["k256", "p256"]

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_MULTICODEC = {"k256": b"\xe7\x01", "p256": b"\x80\x24"}
_TID_CHARS = "234567abcdefghijklmnopqrstuvwxyz"


def base58btc(data: bytes) -> str:
    """Bitcoin-alphabet base58 (no multibase prefix)."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


class SigningKey:
    """A K-256 or P-256 private key that signs with compact low-S ECDSA over SHA-256."""

    def __init__(self, curve: Curve, secret: bytes) -> None:
        self.curve: Curve = curve
        self.secret = secret
        if curve == "k256":
            self._k = coincurve.PrivateKey(secret)
            compressed = self._k.public_key.format(compressed=True)
        elif curve == "p256":
            self._p = ec.derive_private_key(int.from_bytes(secret, "big"), ec.SECP256R1())
            compressed = self._p.public_key().public_bytes(
                serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint
            )
        else:
            raise ValueError(f"unknown curve {curve!r}")
        self.multibase = "z" + base58btc(_MULTICODEC[curve] + compressed)

    @classmethod
    def generate(cls, curve: Curve, rng: random.Random) -> SigningKey:
        """A deterministic key from ``rng`` (valid scalar for both curves)."""
        while True:
            secret = rng.randbytes(32)
            if 0 < int.from_bytes(secret, "big") < _P256_N:
                return cls(curve, secret)

    def did_key(self) -> str:
        """``did:key:z…`` form of the public key."""
        return "did:key:" + self.multibase

    def sign(self, msg: bytes) -> bytes:
        """64-byte compact low-S signature over SHA-256(msg)."""
        if self.curve == "k256":
            return self._k.sign_recoverable(msg, hasher=lambda m: hashlib.sha256(m).digest())[:64]
        r, s = decode_dss_signature(self._p.sign(msg, ec.ECDSA(hashes.SHA256())))
        if s > _P256_N // 2:
            s = _P256_N - s
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def plc_did(rng: random.Random) -> str:
    """A syntactically valid ``did:plc:`` identifier (24 base32 characters)."""
    return "did:plc:" + b32encode(rng.randbytes(15)).decode().lower()[:24]


def tid_from_micros(micros: int, clock_id: int = 0) -> str:
    """Encode a TID: 53-bit microsecond timestamp and 10-bit clock id, base32-sortable."""
    value = (micros << 10) | (clock_id & 0x3FF)
    return "".join(_TID_CHARS[(value >> (60 - 5 * i)) & 31] for i in range(13))


class TidClock:
    """Strictly increasing TIDs, never behind wall-clock time."""

    def __init__(self, clock_id: int = 0) -> None:
        self.clock_id = clock_id
        self._last = 0

    def next(self) -> str:
        now = time.time_ns() // 1000
        self._last = now if now > self._last else self._last + 1
        return tid_from_micros(self._last, self.clock_id)


def did_document(did: str, handle: str, key: SigningKey, pds_url: str) -> dict[str, Any]:
    """The DID document a PLC directory returns for a simulated account."""
    return {
        "@context": [
            "https://www.w3.org/ns/did/v1",
            "https://w3id.org/security/multikey/v1",
            "https://w3id.org/security/suites/secp256k1-2019/v1",
        ],
        "id": did,
        "alsoKnownAs": [f"at://{handle}"],
        "verificationMethod": [
            {
                "id": f"{did}#atproto",
                "type": "Multikey",
                "controller": did,
                "publicKeyMultibase": key.multibase,
            }
        ],
        "service": [
            {"id": "#atproto_pds", "type": "AtprotoPersonalDataServer", "serviceEndpoint": pds_url}
        ],
    }
