"""firehose.lru.BoundedLRU: the one bounded LRU of the code base."""

from __future__ import annotations

import pytest

from firehose.lru import BoundedLRU


def test_evicts_least_recently_used_and_get_refreshes() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)  # evicts b
    assert "b" not in lru and list(lru) == ["a", "c"] and len(lru) == 2


def test_peek_does_not_refresh() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1
    lru.put("c", 3)  # a was only peeked at: it goes
    assert list(lru) == ["b", "c"]


def test_put_replaces_and_refreshes_pop_and_defaults() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    lru.put("a", 10)
    lru.put("c", 3)
    assert list(lru) == ["a", "c"] and lru.get("a") == 10
    assert lru.pop("a") == 10 and lru.pop("a") is None and lru.pop("a", -1) == -1
    assert lru.get("zz") is None and lru.get("zz", 5) == 5 and lru.peek("zz", 6) == 6
    lru.clear()
    assert len(lru) == 0


def test_zero_holds_nothing_negative_is_refused() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(0)
    lru.put("a", 1)
    assert len(lru) == 0
    with pytest.raises(ValueError):
        BoundedLRU(-1)
