"""Strict DAG-CBOR: round trips, canonical encoding and a table of malformed inputs."""

from __future__ import annotations

import dag_cbor
import pytest

from mst import cbor
from mst.cid import CID, cid_for_cbor
from mst.errors import CBORError

_CID = cid_for_cbor(b"\xa0")
_CID_BYTES = b"\xd8\x2a\x58\x25\x00" + _CID.cid_bytes

MALFORMED: list[tuple[str, str, str]] = [
    # (case, hex, expected reason)
    ("non-minimal uint8", "1801", "cbor_non_minimal"),
    ("non-minimal uint16", "190001", "cbor_non_minimal"),
    ("non-minimal uint32", "1a000000ff", "cbor_non_minimal"),
    ("non-minimal uint64", "1b00000000ffffffff", "cbor_non_minimal"),
    ("non-minimal negint", "3800", "cbor_non_minimal"),
    ("non-minimal string length", "780161", "cbor_non_minimal"),
    ("non-minimal bytes length", "580100", "cbor_non_minimal"),
    ("non-minimal array length", "980101", "cbor_non_minimal"),
    ("non-minimal map length", "b80161610101", "cbor_non_minimal"),
    ("unsorted keys (bytewise)", "a2616201616101", "cbor_map_key_order"),
    ("unsorted keys (length first)", "a262616101616201", "cbor_map_key_order"),
    ("duplicate keys", "a2616101616101", "cbor_map_key_order"),
    ("integer map key", "a10101", "cbor_unexpected_type"),
    ("bytes map key", "a1416101", "cbor_unexpected_type"),
    ("indefinite array", "9f01ff", "cbor_indefinite_length"),
    ("indefinite map", "bf616101ff", "cbor_indefinite_length"),
    ("indefinite string", "7f616161ff", "cbor_indefinite_length"),
    ("indefinite bytes", "5f4100ff", "cbor_indefinite_length"),
    ("float16", "f93c00", "cbor_float_not_float64"),
    ("float32", "fa3f800000", "cbor_float_not_float64"),
    ("NaN", "fb7ff8000000000000", "cbor_nan_or_infinity"),
    ("+Inf", "fb7ff0000000000000", "cbor_nan_or_infinity"),
    ("-Inf", "fbfff0000000000000", "cbor_nan_or_infinity"),
    ("tag 1 (epoch time)", "c101", "cbor_invalid_tag"),
    ("tag 2 (bignum)", "c240", "cbor_invalid_tag"),
    ("tag 42 without 0x00 prefix", "d82a5824" + _CID.cid_bytes.hex(), "cbor_invalid_cid"),
    ("tag 42 over a string", "d82a6161", "cbor_unexpected_type"),
    ("tag 42 over garbage CID", "d82a43000102", "cbor_invalid_cid"),
    ("tag 42 over empty CID", "d82a4100", "cbor_invalid_cid"),
    ("tag 42 CIDv1 sha-512", "d82a5845" + "0001711340" + "00" * 64, "cbor_invalid_cid"),
    ("undefined", "f7", "cbor_simple_value"),
    ("simple value 16", "f0", "cbor_simple_value"),
    ("simple value 32", "f820", "cbor_simple_value"),
    ("break outside indefinite", "ff", "cbor_simple_value"),
    ("reserved additional info", "1c", "cbor_invalid_header"),
    ("trailing bytes", "0101", "cbor_trailing_bytes"),
    ("invalid UTF-8 string", "62c328", "cbor_invalid_utf8"),
    ("invalid UTF-8 map key", "a162c32801", "cbor_invalid_utf8"),
    ("empty input", "", "cbor_truncated"),
    ("truncated string", "6261", "cbor_truncated"),
    ("truncated array", "8201", "cbor_truncated"),
    ("uint64 above int64", "1bffffffffffffffff", "cbor_integer_out_of_range"),
    ("negint below int64", "3b8000000000000000", "cbor_integer_out_of_range"),
]


@pytest.mark.parametrize(("case", "hexdata", "reason"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rejected_with_reason(case: str, hexdata: str, reason: str) -> None:
    with pytest.raises(CBORError) as info:
        cbor.decode(bytes.fromhex(hexdata))
    assert info.value.reason == reason
    assert info.value.reason in cbor.CBOR_REASONS


def test_int64_bounds_accepted() -> None:
    assert cbor.decode(bytes.fromhex("1b7fffffffffffffff")) == (1 << 63) - 1
    assert cbor.decode(bytes.fromhex("3b7fffffffffffffff")) == -(1 << 63)


def test_round_trip_all_kinds_matches_oracle() -> None:
    obj = {
        "s": "héllo",
        "i": -12345678901,
        "b": b"\x00\x01",
        "t": True,
        "f": False,
        "n": None,
        "l": [1, [2, {}], "x"],
        "link": _CID,
        "longer key": {"aa": 1, "b": 2},
    }
    data = cbor.encode(obj)
    assert cbor.decode(data) == obj
    # dag_cbor (pure-Python reference) produces identical canonical bytes
    oracle = dag_cbor.decode(data)
    assert dag_cbor.encode(oracle) == data


def test_encode_sorts_keys_length_first() -> None:
    assert cbor.encode({"bb": 1, "a": 2, "c": 3}) == bytes.fromhex("a3616102616303626262" + "01")


def test_decode_prefix_reports_consumed() -> None:
    data = cbor.encode({"op": 1}) + cbor.encode({"x": "y"})
    obj, n = cbor.decode_prefix(data)
    assert obj == {"op": 1}
    assert cbor.decode(data[n:]) == {"x": "y"}


def test_decoded_cid_is_cbrrr_cid() -> None:
    v = cbor.decode(_CID_BYTES)
    assert isinstance(v, CID) and v == _CID


@pytest.mark.parametrize(
    "value",
    [{1: 2}, float("nan"), float("inf"), 1 << 63, -(1 << 63) - 1, {"a": {1}}, (1, 2), object()],
)
def test_unencodable_values(value: object) -> None:
    with pytest.raises(CBORError) as info:
        cbor.encode(value)
    assert info.value.reason in ("cbor_unencodable", "cbor_integer_out_of_range")


def test_accepts_memoryview() -> None:
    data = cbor.encode({"a": [1, 2]})
    assert cbor.decode(memoryview(data)) == {"a": [1, 2]}


def test_nesting_depth_limit() -> None:
    ok = b"\x81" * cbor.MAX_DEPTH + b"\x00"
    assert cbor.decode(ok) is not None
    for deep in (b"\x81" * (cbor.MAX_DEPTH + 1) + b"\x00", b"\xa1\x61a" * 1_000_000 + b"\x00"):
        with pytest.raises(CBORError) as info:
            cbor.decode(deep)
        assert info.value.reason == "cbor_too_deep"
    nested: list = []
    for _ in range(cbor.MAX_DEPTH + 5):
        nested = [nested]
    with pytest.raises(CBORError):
        cbor.encode(nested)


@pytest.mark.parametrize("n", [0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1])
def test_encode_head_is_the_canonical_head(n: int) -> None:
    """``encode_head`` (used by the direct writers: MST nodes, seq splicing) agrees with the encoder."""
    assert cbor.encode_head(0, n) == cbor.encode_trusted(n)
    if n < 70_000:
        assert cbor.encode_head(2, n) + bytes(n) == cbor.encode(bytes(n))
        assert cbor.encode_head(3, n) + b"a" * n == cbor.encode("a" * n)
        assert cbor.encode_head(4, n) + b"\x00" * n == cbor.encode([0] * n)
