"""One bounded LRU mapping, for the process-local caches (account state in the validation
pipeline and in ingest, identities, recent resolutions, handle checks).

``BoundedLRU(maxsize)`` holds at most ``maxsize`` entries (0: holds nothing). ``put`` inserts or
replaces an entry as the most recently used and evicts the least recently used beyond the bound;
``get`` returns an entry *and* marks it used; ``peek`` returns it without marking (a lookup that
must not keep an entry alive); ``pop`` removes one. Not thread-safe (event-loop code only).
An ``OrderedDict`` underneath, so every operation is O(1) and C-level.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["BoundedLRU"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """See the module docstring."""

    __slots__ = ("maxsize", "_data")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, not {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The entry for ``key`` (marked most recently used), else ``default``."""
        data = self._data
        try:
            value = data[key]
        except KeyError:
            return default
        data.move_to_end(key)
        return value

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The entry for ``key`` without marking it used, else ``default``."""
        return self._data.get(key, default)

    def put(self, key: K, value: V) -> None:
        """Insert or replace ``key`` as the most recently used entry; evict beyond ``maxsize``."""
        data = self._data
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.maxsize:
            data.popitem(last=False)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove ``key``; its entry, else ``default``."""
        return self._data.pop(key, default)

    def clear(self) -> None:
        self._data.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._data)
