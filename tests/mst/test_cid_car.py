"""CIDs (blessed form only) and CAR v1 read/write with hash verification and limits."""

from __future__ import annotations

import hashlib

import pytest
from multiformats import CID as MfCID

from mst import cbor
from mst.car import read_car, write_car
from mst.cid import cid_for_cbor, cid_for_raw, cid_from_bytes, is_blessed, parse_cid
from mst.errors import CARError, CIDError


def test_cid_for_cbor_matches_multiformats() -> None:
    data = cbor.encode({"hello": "world"})
    cid = cid_for_cbor(data)
    mf = MfCID("base32", 1, "dag-cbor", ("sha2-256", hashlib.sha256(data).digest()))
    assert cid.encode() == str(mf)
    assert parse_cid(str(mf)) == cid
    assert is_blessed(cid)


def test_cid_for_raw() -> None:
    cid = cid_for_raw(b"blob")
    assert cid.encode().startswith("bafkrei")
    assert parse_cid(cid.encode()) == cid


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "cid_syntax"),
        ("QmbWqxBEKC3P8tqsKc98xmWNzrzDtRLMiMPL8wBuTGsMnR", "cid_syntax"),  # CIDv0
        ("zdj7WWeQ43G6JJvLWQWZpyHuAMq6uYWRjkBXFad11vE2LHhQ7", "cid_syntax"),  # base58
        ("bafybeigdyrzt5sfp7udm7hu76uh7y26nf3efuylqabf3oclgtqy55fbzdi", "cid_not_blessed"),  # dag-pb
        ("BAFYREIE5CVV4H45FEADGEUWHBCUTMH6T2CESEOCCKAHDOE6UAT64ZMZ454", "cid_syntax"),
        ("bafyreie5cvv4h45feadgeuwhbcutmh6t2ceseocckahdoe6uat64zmz45", "cid_syntax"),  # truncated
        ("bafyreie5cvv4h45feadgeuwhbcutmh6t2ceseocckahdoe6uat64zmz45!", "cid_syntax"),
    ],
)
def test_parse_cid_rejects(text: str, reason: str) -> None:
    with pytest.raises(CIDError) as info:
        parse_cid(text)
    assert info.value.reason == reason


def test_cid_from_bytes_rejects_non_blessed() -> None:
    with pytest.raises(CIDError):
        cid_from_bytes(b"\x01\x70\x12\x20" + bytes(32))


def _sample_blocks() -> list[tuple]:
    blocks = []
    for i in range(5):
        data = cbor.encode({"i": i})
        blocks.append((cid_for_cbor(data), data))
    raw = b"raw blob bytes"
    blocks.append((cid_for_raw(raw), raw))
    return blocks


def test_car_round_trip() -> None:
    blocks = _sample_blocks()
    car_bytes = write_car([blocks[0][0]], blocks)
    car = read_car(car_bytes)
    assert car.roots == [blocks[0][0]]
    assert car.root == blocks[0][0]
    assert car.blocks == dict(blocks)


def test_car_duplicate_blocks_tolerated() -> None:
    blocks = _sample_blocks()
    car = read_car(write_car([blocks[0][0]], blocks + blocks[:2]))
    assert len(car.blocks) == len(blocks)


def test_car_hash_mismatch() -> None:
    blocks = _sample_blocks()
    cid, data = blocks[1]
    bad = write_car([blocks[0][0]], [blocks[0], (cid, data[:-1] + b"\x07")])
    with pytest.raises(CARError) as info:
        read_car(bad)
    assert info.value.reason == "car_hash_mismatch"


def _header(obj: object) -> bytes:
    h = cbor.encode(obj)
    return bytes([len(h)]) + h


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "car_truncated"),
        (b"\x80", "car_truncated"),
        (b"\x80\x00", "car_varint"),
        (b"\x05\xa0", "car_truncated"),
        (_header({"version": 1}), "car_header_invalid"),
        (_header({"version": 2, "roots": []}), "car_version"),
        (_header({"version": 1, "roots": []}), "car_no_roots"),
        (_header({"version": 1, "roots": ["x"]}), "car_header_invalid"),
        (_header([1]), "car_header_invalid"),
        (b"\x03\xa1\x01\x01", "car_header_invalid"),  # not DAG-CBOR
    ],
)
def test_car_malformed(data: bytes, reason: str) -> None:
    with pytest.raises(CARError) as info:
        read_car(data)
    assert info.value.reason == reason


def test_car_block_errors() -> None:
    blocks = _sample_blocks()
    root = blocks[0][0]
    head = write_car([root], [])
    # a block section with a CIDv0 / unsupported CID
    body = b"\x12\x20" + bytes(32) + b"x"
    with pytest.raises(CARError) as info:
        read_car(head + bytes([len(body)]) + body)
    assert info.value.reason == "car_cid_invalid"
    # truncated section
    full = write_car([root], blocks)
    with pytest.raises(CARError) as info:
        read_car(full[:-3])
    assert info.value.reason == "car_truncated"


def test_car_limits() -> None:
    blocks = _sample_blocks()
    car_bytes = write_car([blocks[0][0]], blocks)
    with pytest.raises(CARError) as info:
        read_car(car_bytes, max_blocks=3)
    assert info.value.reason == "car_too_many_blocks"
    with pytest.raises(CARError) as info:
        read_car(car_bytes, max_block_bytes=8)
    assert info.value.reason == "car_block_too_large"
    with pytest.raises(CARError) as info:
        read_car(car_bytes, max_total_bytes=len(car_bytes) - 1)
    assert info.value.reason == "car_too_large"
    assert len(read_car(car_bytes, max_blocks=6).blocks) == 6


def test_car_limits_at_their_boundaries() -> None:
    """Limits hold exactly, including for the smallest possible block sections (an empty raw
    block takes 37 bytes) and for one block that is the whole CAR."""
    empty = (cid_for_raw(b""), b"")
    for n in (1, 2, 5):
        car_bytes = write_car([empty[0]], [empty] * n)  # duplicates count as blocks
        assert len(read_car(car_bytes, max_blocks=n).blocks) == 1
        with pytest.raises(CARError) as info:
            read_car(car_bytes, max_blocks=n - 1)
        assert info.value.reason == "car_too_many_blocks"
    data = b"x" * 300
    car_bytes = write_car([cid_for_raw(data)], [(cid_for_raw(data), data)])
    assert read_car(car_bytes, max_block_bytes=300).blocks[cid_for_raw(data)] == data
    with pytest.raises(CARError) as info:
        read_car(car_bytes, max_block_bytes=299)
    assert info.value.reason == "car_block_too_large"
    # blocks on both sides of the hashing-implementation switch are verified alike
    for size in (766, 767, 768, 769, 5000):
        blob = bytes(range(256)) * (size // 256) + bytes(size % 256)
        good = write_car([cid_for_raw(blob)], [(cid_for_raw(blob), blob)])
        assert read_car(good).blocks[cid_for_raw(blob)] == blob
        bad = good[:-1] + bytes([good[-1] ^ 1])
        with pytest.raises(CARError) as info:
            read_car(bad)
        assert info.value.reason == "car_hash_mismatch"


def test_hash_helpers_agree_with_hashlib_across_the_size_switch() -> None:
    from mst.cid import SMALL_HASH_BYTES, sha256_digest

    for size in (0, 1, 36, SMALL_HASH_BYTES - 1, SMALL_HASH_BYTES, SMALL_HASH_BYTES + 1, 4096):
        data = bytes((i * 7) & 0xFF for i in range(size))
        digest = hashlib.sha256(data).digest()
        assert sha256_digest(data) == digest
        assert cid_for_cbor(data).cid_bytes == b"\x01\x71\x12\x20" + digest
        assert cid_for_raw(data).cid_bytes == b"\x01\x55\x12\x20" + digest
