"""Memory freed by a burst is given back to the operating system (``firehose.memtrim``): after many
large buffers are freed inside malloc's heaps the trimmer sees the RSS stand above its rest with
that much resident free memory and returns whole pages (RSS drops); memory freed again after a
trim, once re-used, is given back too; memory in use, or a process at rest, is never trimmed."""

from __future__ import annotations

import pytest

from firehose.memtrim import MemoryTrimmer, glibc_trimmer

MB = 1024 * 1024
BUF = 100_000  # below the mmap threshold: inside the heap


def trimmer_or_fail(**kwargs: float) -> MemoryTrimmer:
    """A trimmer whose rest is this process at rest: the test process has run other tests, whose
    freed memory would otherwise count as part of its rest, so it is given back first."""
    first = glibc_trimmer()
    if first is None:
        pytest.fail("this test runs on glibc (the relay's image and the standard machine)")
    first.trim_now()
    trimmer = glibc_trimmer(**kwargs)
    assert trimmer is not None
    return trimmer


def buffer() -> bytearray:
    """A buffer whose pages are written (resident), not left to calloc's untouched pages."""
    return bytearray(b"x" * BUF)


async def test_freed_heap_memory_goes_back_and_a_second_check_costs_nothing() -> None:
    trimmer = trimmer_or_fail(min_free=16 * MB)
    kept, freed = [], []
    for i in range(1200):  # ~120 MB of 100 KB buffers
        (kept if i % 4 == 0 else freed).append(buffer())
    freed.clear()  # ~90 MB free between live buffers: nothing can be given back from the heap's top
    returned = await trimmer.maybe_trim()
    assert returned >= 32 * MB
    assert trimmer.stats.trims == 1
    assert await trimmer.maybe_trim() == 0 and trimmer.stats.trims == 1  # nothing new freed: no trim
    del kept


def test_tick_checks_at_most_once_an_interval_and_then_trims_in_place() -> None:
    """What a validation worker calls between batches: no look before ``interval`` has passed
    since the last one, then the same rule as ``maybe_trim`` (here and now: no event loop)."""
    patient = trimmer_or_fail(min_free=16 * MB, interval=3600.0)
    trimmer = trimmer_or_fail(min_free=16 * MB, interval=0.0)
    kept, freed = [], []
    for i in range(1200):
        (kept if i % 4 == 0 else freed).append(buffer())
    freed.clear()
    assert patient.tick() == 0 and patient.stats.trims == 0  # within its interval: not even a look
    assert trimmer.tick() >= 32 * MB
    assert trimmer.stats.trims == 1
    assert trimmer.tick() == 0 and trimmer.stats.trims == 1  # nothing new freed: no trim
    del kept


async def test_memory_reused_after_a_trim_and_freed_again_goes_back() -> None:
    """A crowd's tail: a trim during the burst, then the given-back pages are used again (faulted
    back in) and freed once more by the leaving crowd. They go back at the next check."""
    trimmer = trimmer_or_fail(min_free=32 * MB)
    kept, freed = [], []
    for i in range(1200):
        (kept if i % 4 == 0 else freed).append(buffer())
    freed.clear()
    assert await trimmer.maybe_trim() >= 32 * MB
    again = [bytearray(b"x" * BUF) for _ in range(500)]  # ~50 MB written into the given-back pages
    again.clear()
    assert await trimmer.maybe_trim() >= 32 * MB
    assert trimmer.stats.trims == 2
    del kept


async def test_memory_in_use_and_a_process_at_rest_are_not_trimmed() -> None:
    trimmer = trimmer_or_fail(min_free=16 * MB)
    assert await trimmer.maybe_trim() == 0  # at rest
    live = [bytearray(b"y" * BUF) for _ in range(600)]  # ~60 MB in use above rest
    for _ in range(3):
        assert await trimmer.maybe_trim() == 0
    assert trimmer.stats.trims == 0
    del live
