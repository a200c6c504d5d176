"""The parsed-key cache is bounded in bytes: each key charged by its curve, the least recently used
going first; parse failures are not kept."""

from __future__ import annotations

import pytest

from mst import crypto
from mst.crypto import KEY_ENTRY_BYTES as ENTRY_BYTES
from mst.crypto import PrivateKey, PublicKey, parse_did_key, parse_multibase_key
from mst.errors import KeyFormatError
from mst.key_cache import KeyCache


def _cache(budget: int) -> KeyCache[PublicKey]:
    return KeyCache(budget, lambda key: ENTRY_BYTES[key.curve])


def _keys(curve: crypto.Curve, n: int) -> list[PublicKey]:
    make = PrivateKey.generate_k256 if curve == "k256" else PrivateKey.generate_p256
    return [make().public_key for _ in range(n)]


def test_the_budget_holds_in_bytes_with_each_curve_charged_its_size() -> None:
    cache = _cache(4 * ENTRY_BYTES["k256"])
    k256 = _keys("k256", 6)
    for key in k256:
        assert cache.get(key.did_key(), lambda key=key: key) is key
    assert len(cache) == 4 and cache.size_bytes == 4 * ENTRY_BYTES["k256"]
    p256 = _keys("p256", 1)[0]
    assert ENTRY_BYTES["p256"] > 2 * ENTRY_BYTES["k256"]  # one P-256 key pushes out more than one K-256
    cache.get(p256.did_key(), lambda: p256)
    expected_k256 = (4 * ENTRY_BYTES["k256"] - ENTRY_BYTES["p256"]) // ENTRY_BYTES["k256"]
    assert len(cache) == 1 + expected_k256
    assert cache.size_bytes == ENTRY_BYTES["p256"] + expected_k256 * ENTRY_BYTES["k256"] <= cache.budget_bytes


def test_the_least_recently_used_key_goes_first() -> None:
    cache = _cache(3 * ENTRY_BYTES["k256"])
    a, b, c, d = _keys("k256", 4)
    parses: list[str] = []

    def get(key: PublicKey) -> PublicKey:
        def parse() -> PublicKey:
            parses.append(key.did_key())
            return key
        return cache.get(key.did_key(), parse)

    for key in (a, b, c):
        get(key)
    get(a)  # a is now the most recently used: b goes when d comes
    get(d)
    parses.clear()
    for key in (a, c, d):
        assert get(key) is key
    assert parses == []  # all three were still cached
    get(b)
    assert parses == [b.did_key()]  # b had gone


def test_a_key_larger_than_the_budget_is_returned_and_not_kept() -> None:
    cache = _cache(ENTRY_BYTES["k256"])
    p256 = _keys("p256", 1)[0]
    assert cache.get("x", lambda: p256) is p256
    assert len(cache) == 0 and cache.size_bytes == 0


def test_parse_failures_are_not_cached() -> None:
    cache = _cache(1 << 20)
    calls = 0

    def bad() -> PublicKey:
        nonlocal calls
        calls += 1
        raise KeyFormatError("key_invalid_point", "no")

    for _ in range(2):
        with pytest.raises(KeyFormatError):
            cache.get("bad", bad)
    assert calls == 2 and len(cache) == 0


def test_did_keys_and_document_keys_share_the_process_cache() -> None:
    key = PrivateKey.generate_p256().public_key
    crypto.KEYS.clear()
    first = parse_did_key(key.did_key())
    assert parse_did_key(key.did_key()) is first
    assert parse_multibase_key("Multikey", key.multikey()) == key
    assert len(crypto.KEYS) == 2 and crypto.KEYS.size_bytes == 2 * ENTRY_BYTES["p256"]
    with pytest.raises(KeyFormatError):
        parse_did_key("did:key:zBAD0")
    assert len(crypto.KEYS) == 2
