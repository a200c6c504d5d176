"""Memory freed by a burst is given back to the operating system (``firehose.memtrim``): after many
large buffers are freed inside malloc's heaps, the trimmer sees the free bytes grow and returns
whole pages (RSS drops); when nothing new was freed it does nothing (an idle relay pays nothing)."""

from __future__ import annotations

import pytest

from firehose.memtrim import glibc_trimmer


async def test_freed_heap_memory_goes_back_and_an_idle_check_costs_nothing() -> None:
    trimmer = glibc_trimmer(min_free=16 * 1024 * 1024)
    if trimmer is None:
        pytest.fail("this test runs on glibc (the relay's image and the standard machine)")
    kept, freed = [], []
    for i in range(1200):  # ~120 MB of 100 KB buffers (below the mmap threshold: inside the heap)
        (kept if i % 4 == 0 else freed).append(bytearray(100_000))
    freed.clear()  # ~90 MB free between live buffers: nothing can be given back from the heap's top
    assert trimmer.free_bytes() >= 64 * 1024 * 1024
    returned = await trimmer.maybe_trim()
    assert returned >= 32 * 1024 * 1024
    assert trimmer.stats.trims == 1
    assert await trimmer.maybe_trim() == 0 and trimmer.stats.trims == 1  # nothing new freed: no trim
    del kept


def test_tick_checks_at_most_once_an_interval_and_then_trims_in_place() -> None:
    """What a validation worker calls between batches: no look before ``interval`` has passed
    since the last one, then the same rule as ``maybe_trim`` (here and now: no event loop)."""
    patient = glibc_trimmer(min_free=16 * 1024 * 1024, interval=3600.0)
    trimmer = glibc_trimmer(min_free=16 * 1024 * 1024, interval=0.0)
    if trimmer is None or patient is None:
        pytest.fail("this test runs on glibc (the relay's image and the standard machine)")
    kept, freed = [], []
    for i in range(1200):
        (kept if i % 4 == 0 else freed).append(bytearray(100_000))
    freed.clear()
    assert trimmer.free_bytes() >= 64 * 1024 * 1024
    assert patient.tick() == 0 and patient.stats.trims == 0  # within its interval: not even a look
    assert trimmer.tick() >= 32 * 1024 * 1024
    assert trimmer.stats.trims == 1
    assert trimmer.tick() == 0 and trimmer.stats.trims == 1  # nothing new freed: no trim
    del kept
