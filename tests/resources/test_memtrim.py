"""Memory freed by a burst is given back to the operating system (``relay.memtrim``): after many
large buffers are freed inside malloc's heaps the trimmer sees the RSS stand above its rest and
returns whole pages (RSS drops); memory freed again after a trim, once re-used, is given back too;
while what stands above rest is in use, trims come at doubling spacing; at rest nothing runs."""

from __future__ import annotations

import pytest

from relay.memtrim import MemoryTrimmer, glibc_trimmer

MB = 1024 * 1024
BUF = 100_000  # below the mmap threshold: inside the heap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def trimmer_or_fail(clock: Clock, **kwargs: float) -> MemoryTrimmer:
    trimmer = glibc_trimmer(clock=clock, **kwargs)  # type: ignore[arg-type]
    if trimmer is None:
        pytest.fail("this test runs on glibc (the relay's image and the standard machine)")
    return trimmer


async def test_freed_heap_memory_goes_back_and_an_idle_check_costs_nothing() -> None:
    clock = Clock()
    trimmer = trimmer_or_fail(clock, min_free=16 * MB, interval=5.0)
    kept, freed = [], []
    for i in range(1200):  # ~120 MB of 100 KB buffers
        (kept if i % 4 == 0 else freed).append(bytearray(BUF))
    freed.clear()  # ~90 MB free between live buffers: nothing can be given back from the heap's top
    returned = await trimmer.maybe_trim()
    assert returned >= 32 * MB
    assert trimmer.stats.trims == 1
    assert await trimmer.maybe_trim() == 0 and trimmer.stats.trims == 1  # within the spacing: no trim
    del kept


async def test_memory_reused_after_a_trim_and_freed_again_goes_back() -> None:
    """The crowd's tail: a trim during the burst, then the freed pages are used again (faulted
    back in) and freed once more by the leaving crowd. They must go back at the next check."""
    clock = Clock()
    trimmer = trimmer_or_fail(clock, min_free=32 * MB, interval=5.0)
    kept, freed = [], []
    for i in range(1200):
        (kept if i % 4 == 0 else freed).append(bytearray(BUF))
    freed.clear()
    assert await trimmer.maybe_trim() >= 32 * MB
    again = [bytearray(b"x" * BUF) for _ in range(250)]  # ~25 MB written into the given-back pages
    again.clear()
    clock.now += 5.0
    assert await trimmer.maybe_trim() >= 16 * MB
    assert trimmer.stats.trims == 2
    del kept


async def test_memory_in_use_is_asked_for_at_doubling_spacing() -> None:
    clock = Clock()
    trimmer = trimmer_or_fail(clock, min_free=16 * MB, interval=5.0, max_interval=20.0)
    assert await trimmer.maybe_trim() == 0 and trimmer.stats.trims == 0  # at rest: nothing runs
    live = [bytearray(b"y" * BUF) for _ in range(400)]  # ~40 MB in use above rest
    spacing = []
    for _ in range(8):
        before = trimmer.stats.trims
        await trimmer.maybe_trim()
        if trimmer.stats.trims > before:
            spacing.append(clock.now)
        clock.now += 5.0
    gaps = [b - a for a, b in zip(spacing, spacing[1:], strict=False)]
    assert gaps == [10.0, 20.0], gaps  # 5 s checks: trims after 10 s, then at most every 20 s
    del live
