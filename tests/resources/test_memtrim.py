"""Memory freed by a burst is given back to the operating system (``relay.memtrim``): after many
large buffers are freed inside malloc's heaps, the trimmer sees the free bytes grow and returns
whole pages (RSS drops); when nothing new was freed it does nothing (an idle relay pays nothing)."""

from __future__ import annotations

import pytest

from relay.memtrim import glibc_trimmer


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
