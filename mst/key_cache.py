"""A least-recently-used cache bounded in bytes: each entry is charged the size its owner says it
holds (``size_of``), and the least recently used entries go when the budget is full.

:mod:`mst.crypto` keeps its parsed public keys in one (``crypto.KEYS``): a parsed key is not one
size (K-256 ~0.5 KB, P-256 ~2.4 KB with the entry, measured), so a cache bounded by count would
hold 4.5× more memory when unusual identities bring P-256 keys.

Failures are not cached: a value whose parse raises is parsed again (and refused) each time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class KeyCache(Generic[V]):
    """Least-recently-used values whose charged sizes (``size_of(value)``) sum to at most
    ``budget_bytes``. Lookups take no lock; stores do (safe from several threads)."""

    def __init__(self, budget_bytes: int, size_of: Callable[[V], int]) -> None:
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def lookup(self, key: Hashable) -> V | None:
        """The cached value for ``key`` (now the most recently used), or None. A hit is two C-level
        dict operations (measured ~0.3 µs, against ~0.15 µs for an ``lru_cache`` hit and ~20 µs
        to parse a K-256 key)."""
        found = self._entries.get(key)
        if found is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:  # evicted by another thread in between: still a valid value
                pass
        return found

    def store(self, key: Hashable, value: V) -> V:
        """Keep ``value`` under ``key`` (the least recently used go past the budget); returns it.
        A value larger than the whole budget is returned and not kept."""
        size = self._size_of(value)
        if size > self.budget_bytes:
            return value
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._size_of(old)
            self._entries[key] = value
            self._bytes += size
            while self._bytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= self._size_of(gone)
        return value

    def get(self, key: Hashable, parse: Callable[[], V]) -> V:
        """The cached value for ``key``, else ``parse()``'s result, cached (its errors propagate)."""
        found = self.lookup(key)
        return found if found is not None else self.store(key, parse())

    @property
    def size_bytes(self) -> int:
        """The charged size of what is cached now (at most ``budget_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
