"""Identifier syntax against every interop syntax file (whitespace preserved), TIDs, and the
JSON data-model vectors."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from mst import cbor, syntax
from mst.cid import cid_for_cbor
from mst.datamodel import data_to_json, json_to_data, validate_data
from mst.errors import DataModelError, InvalidIdentifier
from mst.tid import TidClock, int_to_tid, tid_to_int, tid_to_micros
from tests.mst.conftest import load_json

VALIDATORS = {
    "did": syntax.is_valid_did,
    "handle": syntax.is_valid_handle,
    "nsid": syntax.is_valid_nsid,
    "tid": syntax.is_valid_tid,
    "recordkey": syntax.is_valid_record_key,
    "aturi": syntax.is_valid_at_uri,
    "datetime": syntax.is_valid_datetime,
    "uri": syntax.is_valid_uri,
    "cid": syntax.is_valid_cid_string,
    "language": syntax.is_valid_language,
    "atidentifier": syntax.is_valid_at_identifier,
}


def _lines(path: Path) -> list[str]:
    # split on '\n' only: leading/trailing spaces in a vector are part of the vector
    return [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln and not ln.startswith("#")]


def test_every_syntax_file_is_covered(interop_dir: Path) -> None:
    for path in (interop_dir / "syntax").glob("*.txt"):
        assert path.name.split("_")[0] in VALIDATORS, path.name


@pytest.mark.parametrize("name", sorted(VALIDATORS))
def test_syntax_vectors(interop_dir: Path, name: str) -> None:
    fn = VALIDATORS[name]
    d = interop_dir / "syntax"
    checked = 0
    for kind, expected in (("syntax_valid", True), ("syntax_invalid", False), ("parse_invalid", False)):
        path = d / f"{name}_{kind}.txt"
        if not path.exists():
            continue
        for line in _lines(path):
            assert fn(line) is expected, f"{path.name}: {line[:80]!r}"
            checked += 1
    assert checked > 0


def test_ensure_raises_typed() -> None:
    with pytest.raises(InvalidIdentifier) as info:
        syntax.ensure_valid_did("did:x")
    assert info.value.reason == "invalid_did"
    syntax.ensure_valid_repo_path("app.bsky.feed.post/3jzfcijpj2z2a")
    with pytest.raises(InvalidIdentifier):
        syntax.ensure_valid_repo_path("app.bsky.feed.post")
    with pytest.raises(InvalidIdentifier):
        syntax.ensure_valid_repo_path("app.bsky.feed.post/..")


def test_tid_clock_monotonic_even_if_time_stalls() -> None:
    clock = TidClock(clock_id=7, now_micros=lambda: 1_700_000_000_000_000)
    tids = [clock.next() for _ in range(100)]
    assert tids == sorted(tids) and len(set(tids)) == 100
    assert all(syntax.is_valid_tid(t) for t in tids)
    assert tid_to_micros(tids[0]) == 1_700_000_000_000_000
    assert tid_to_int(tids[0]) & 1023 == 7
    later = clock.next_after(int_to_tid((1_800_000_000_000_000 << 10) | 3))
    assert tid_to_micros(later) == 1_800_000_000_000_001


def test_tid_round_trip() -> None:
    for n in (0, 1, 12345678901234, (1 << 63) - 1):
        assert tid_to_int(int_to_tid(n)) == n
    with pytest.raises(InvalidIdentifier):
        tid_to_int("zzzzzzzzzzzzz")


def test_data_model_fixtures_bytes_and_cids(interop_dir: Path) -> None:
    vectors = load_json(interop_dir / "data-model" / "data-model-fixtures.json")
    assert vectors
    for v in vectors:
        data = json_to_data(v["json"])
        encoded = cbor.encode(data)
        expected = base64.b64decode(v["cbor_base64"] + "=" * (-len(v["cbor_base64"]) % 4))
        assert encoded == expected
        assert cid_for_cbor(encoded).encode() == v["cid"]
        decoded = cbor.decode(expected)
        assert decoded == data
        assert data_to_json(decoded) == v["json"]
        validate_data(decoded)


def test_data_model_valid_and_invalid_json(interop_dir: Path) -> None:
    for v in load_json(interop_dir / "data-model" / "data-model-valid.json"):
        data = json_to_data(v["json"])
        validate_data(cbor.decode(cbor.encode(data)))
    invalid = load_json(interop_dir / "data-model" / "data-model-invalid.json")
    assert invalid
    for v in invalid:
        with pytest.raises(DataModelError):
            json_to_data(v["json"])


def test_validate_data_rejects_floats_in_cbor() -> None:
    with pytest.raises(DataModelError) as info:
        validate_data(cbor.decode(cbor.encode({"a": 1.5})))
    assert info.value.reason == "float_not_allowed"
    assert json.dumps(data_to_json({"b": b"\x01"})) == '{"b": {"$bytes": "AQ"}}'
