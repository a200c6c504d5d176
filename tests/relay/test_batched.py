"""relay.batched.BatchedLookup: coalescing, freshness across an in-flight query, errors."""

from __future__ import annotations

import asyncio

import pytest

from relay.batched import BatchedLookup


class Table:
    """A key-value table whose batched reads can be held in flight."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.queries: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def fetch(self, keys: list[str]) -> dict[str, int]:
        self.queries.append(list(keys))
        snapshot = {k: self.rows[k] for k in keys if k in self.rows}  # read when the query starts
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return snapshot


async def test_lookups_of_one_turn_share_one_query_in_batches() -> None:
    table = Table()
    table.rows = {f"k{i}": i for i in range(5)}
    lookup = BatchedLookup(table.fetch, max_batch=3)
    got = await asyncio.gather(*(lookup.get(f"k{i}") for i in range(5)), lookup.get("k1"), lookup.get("nope"))
    assert got == [0, 1, 2, 3, 4, 1, None]
    assert table.queries == [["k0", "k1", "k2"], ["k3", "k4", "nope"]]
    assert lookup.queries == 2


async def test_a_lookup_never_joins_a_query_that_started_before_it() -> None:
    table = Table()
    table.rows = {"a": 1}
    lookup = BatchedLookup(table.fetch)
    table.gate.clear()
    first = asyncio.ensure_future(lookup.get("a"))
    while not table.queries:
        await asyncio.sleep(0)
    table.rows["a"] = 2  # written after the first query read it
    second = asyncio.ensure_future(lookup.get("a"))
    await asyncio.sleep(0)
    table.gate.set()
    assert await first == 1
    assert await second == 2
    assert table.queries == [["a"], ["a"]]


async def test_a_failing_query_fails_every_lookup_of_its_batch_only() -> None:
    table = Table()
    table.rows = {"a": 1}
    lookup = BatchedLookup(table.fetch)
    table.fail = OSError("store down")
    results = await asyncio.gather(lookup.get("a"), lookup.get("b"), return_exceptions=True)
    assert [type(r) for r in results] == [OSError, OSError]
    table.fail = None
    assert await lookup.get("a") == 1
    await lookup.wait_idle()


async def test_cancelled_lookup_leaves_the_others_answered() -> None:
    table = Table()
    table.rows = {"a": 1, "b": 2}
    lookup = BatchedLookup(table.fetch)
    table.gate.clear()
    a = asyncio.ensure_future(lookup.get("a"))
    b = asyncio.ensure_future(lookup.get("b"))
    await asyncio.sleep(0)
    a.cancel()
    table.gate.set()
    assert await b == 2
    with pytest.raises(asyncio.CancelledError):
        await a
