"""The synthetic store rows of ``bench/scale.py``: made two characters per look-up for speed, they
must still be what the network would hold (valid, distinct, in DID order)."""

from __future__ import annotations

import random

import cbrrr

from bench.scale import _cid_maker, _synthetic_did, _tid
from sim.ident import tid_from_micros

_SORTED_B32 = "234567abcdefghijklmnopqrstuvwxyz"


def _did_per_character(value: int) -> str:
    """The plain definition: 24 characters, five bits each, most significant first."""
    return "did:plc:" + "".join(_SORTED_B32[(value >> (115 - 5 * i)) & 31] for i in range(24))


def test_tid_matches_the_simulator_encoding() -> None:
    rng = random.Random(1)
    for micros in [0, 1, (1 << 53) - 1, *(rng.randrange(1 << 53) for _ in range(2000))]:
        assert _tid(micros) == tid_from_micros(micros)


def test_synthetic_dids_are_the_per_character_encoding_and_sort_like_their_numbers() -> None:
    rng = random.Random(2)
    values = sorted({0, (1 << 120) - 1, *(rng.getrandbits(120) for _ in range(2000))})
    dids = [_synthetic_did(v) for v in values]
    assert dids == [_did_per_character(v) for v in values]
    assert dids == sorted(dids)
    assert all(len(d) == len("did:plc:") + 24 for d in dids)


def test_synthetic_cids_are_valid_and_distinct() -> None:
    make = _cid_maker(b"c")
    numbers = [*range(1500), 123_456_789, (1 << 40) - 1]
    texts = [make(i) for i in numbers]
    assert len(set(texts)) == len(texts)
    for text in texts:
        assert str(cbrrr.CID.decode(text).encode()) == text
        assert text.startswith("bafyrei")
    assert not set(texts) & {_cid_maker(b"d")(i) for i in numbers}
