"""Keys and signatures against the interop crypto vectors; low-S compact only."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from mst.crypto import (
    K256_ORDER,
    P256_ORDER,
    PrivateKey,
    base58_decode,
    base58_encode,
    parse_did_key,
    parse_multibase_key,
)
from mst.errors import KeyFormatError
from tests.mst.conftest import load_json


def _b64(s: str) -> bytes:
    return base64.b64decode(s + "=" * (-len(s) % 4))


def test_signature_fixtures(interop_dir: Path) -> None:
    fixtures = load_json(interop_dir / "crypto" / "signature-fixtures.json")
    assert len(fixtures) == 6
    for fx in fixtures:
        key = parse_did_key(fx["publicKeyDid"])
        assert key.curve == ("p256" if fx["algorithm"] == "ES256" else "k256")
        assert key.did_key() == fx["publicKeyDid"]
        legacy = parse_multibase_key(fx["didDocSuite"], fx["publicKeyMultibase"])
        assert legacy == key
        msg, sig = _b64(fx["messageBase64"]), _b64(fx["signatureBase64"])
        assert key.verify(msg, sig) is fx["validSignature"], fx["comment"]


def test_high_s_and_der_fixture_signatures_are_otherwise_genuine(interop_dir: Path) -> None:
    """The high-S fixture signatures are real signatures: normalising S makes them verify,
    which proves the rejection is due to the low-S rule and not a broken key."""
    for fx in load_json(interop_dir / "crypto" / "signature-fixtures.json"):
        if "high-s" not in fx["tags"]:
            continue
        key = parse_did_key(fx["publicKeyDid"])
        sig = _b64(fx["signatureBase64"])
        order = K256_ORDER if key.curve == "k256" else P256_ORDER
        s = int.from_bytes(sig[32:], "big")
        low = sig[:32] + (order - s).to_bytes(32, "big")
        assert key.verify(_b64(fx["messageBase64"]), low)


@pytest.mark.parametrize("name", ["w3c_didkey_K256.json", "w3c_didkey_P256.json"])
def test_did_key_derivation(interop_dir: Path, name: str) -> None:
    curve = "k256" if "K256" in name else "p256"
    vectors = load_json(interop_dir / "crypto" / name)
    assert vectors
    for v in vectors:
        if "privateKeyBytesHex" in v:
            raw = bytes.fromhex(v["privateKeyBytesHex"])
        else:
            raw = base58_decode(v["privateKeyBytesBase58"])
        key = PrivateKey.from_bytes(curve, raw)
        assert key.did_key() == v["publicDidKey"]
        assert parse_did_key(v["publicDidKey"]) == key.public_key


@pytest.mark.parametrize("curve", ["k256", "p256"])
def test_sign_verify_low_s(curve: str) -> None:
    key = PrivateKey.generate_k256() if curve == "k256" else PrivateKey.generate_p256()
    order = K256_ORDER if curve == "k256" else P256_ORDER
    pub = parse_did_key(key.did_key())
    for i in range(20):
        msg = f"message {i}".encode()
        sig = key.sign(msg)
        assert len(sig) == 64
        assert int.from_bytes(sig[32:], "big") <= order // 2
        assert pub.verify(msg, sig)
        assert not pub.verify(msg + b"!", sig)
        high = sig[:32] + (order - int.from_bytes(sig[32:], "big")).to_bytes(32, "big")
        assert not pub.verify(msg, high)
        assert not pub.verify(msg, sig[:63])
        assert not pub.verify(msg, bytes(64))


def test_private_key_round_trip() -> None:
    key = PrivateKey.generate_p256()
    again = PrivateKey.from_bytes("p256", key.to_bytes())
    assert again.did_key() == key.did_key()


def test_legacy_uncompressed_multibase() -> None:
    legacy = "zQYEBzXeuTM9UR3rfvNag6L3RNAs5pQZyYPsomTsgQhsxLdEgCrPTLgFna8yqCnxPpNT7DBk6Ym3dgPKNu86vt9GR"
    key = parse_multibase_key("EcdsaSecp256k1VerificationKey2019", legacy)
    assert key.curve == "k256"
    assert parse_multibase_key("Multikey", key.multikey()) == key


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("did:web:example.com", "did_key_syntax"),
        ("did:key:abc", "did_key_syntax"),
        ("did:key:z0OIl", "base58_invalid"),
        ("did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK", "key_unsupported_curve"),
        ("did:key:z" + base58_encode(b"\xe7\x01" + bytes(32)), "key_invalid_point"),
        ("did:key:z" + base58_encode(b"\xe7\x01\x02" + b"\xff" * 32), "key_invalid_point"),
        ("did:key:z" + base58_encode(b"\x80\x24\x04" + b"\x11" * 32), "key_invalid_point"),
    ],
)
def test_parse_did_key_errors(text: str, reason: str) -> None:
    with pytest.raises(KeyFormatError) as info:
        parse_did_key(text)
    assert info.value.reason == reason


def test_invalid_point_rejected() -> None:
    with pytest.raises(KeyFormatError) as info:
        parse_multibase_key("EcdsaSecp256r1VerificationKey2019", "z" + "1" * 40)
    assert info.value.reason == "key_invalid_point"
