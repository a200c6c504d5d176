"""Event builders shared by the backfill tests and the crash-test child process, and a real store
whose writes can be made to fail (``with_faults``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from backfill.store import BatchWrite, Store, WriterLease
from firehose.state import AccountState, PendingEvent, SequencedEvent


def rev_for(n: int) -> str:
    """A TID-shaped rev that sorts by ``n``."""
    alphabet = "234567abcdefghijklmnopqrstuvwxyz"
    out = ""
    value = n + (1 << 50)
    for _ in range(13):
        out = alphabet[value & 31] + out
        value >>= 5
    return out


def commit_event(
    n: int, *, did: str | None = None, host: str = "pds.example", pad: int = 2048
) -> PendingEvent:
    """Upstream event number ``n`` (its upstream seq) for ``did`` with rev ``rev_for(n)``."""
    did = did or f"did:plc:acct{n % 17:04d}"
    rev = rev_for(n)
    body = {
        "repo": did,
        "rev": rev,
        "since": None,
        "blocks": bytes([n % 251]) * pad,
        "ops": [],
        "time": "2026-01-01T00:00:00.000Z",
        "upstream": n,
    }
    state = AccountState(did=did, host=host, rev=rev, commit_cid=f"bafycommit{n}", data_cid=f"bafydata{n}")
    return PendingEvent("#commit", did, body, rev=rev, account=state, host=host, upstream_seq=n)


class Collector:
    """A ``publish`` callable that records what it was given."""

    def __init__(self) -> None:
        self.batches: list[list[SequencedEvent]] = []

    async def __call__(self, events: list[SequencedEvent]) -> None:
        self.batches.append(list(events))

    @property
    def events(self) -> list[SequencedEvent]:
        return [e for batch in self.batches for e in batch]


class FaultyLease(WriterLease):
    """A real lease whose ``commit_batch`` can be made to stop at a chosen batch, wait for the
    test's go-ahead, and then fail with the test's error (once); to fail while the store is
    "down"; or to lose the reply of a commit that was made (``Faults``)."""

    def __init__(self, inner: WriterLease, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    async def commit_batch(self, batch: BatchWrite) -> None:
        f = self.faults
        if f.down:
            f.refused += 1
            raise OSError("store unreachable (injected)")
        if f.trigger is not None and f.trigger(batch):
            f.trigger = None
            f.reached.set()
            await f.go.wait()
            if f.error is not None:
                raise f.error
        await self.inner.commit_batch(batch)
        if f.lose_reply > 0:
            f.lose_reply -= 1
            raise OSError("connection lost after COMMIT (injected)")
        if f.after_commit is not None:
            error, f.after_commit = f.after_commit, None
            raise error

    async def high_water(self) -> int:
        f = self.faults
        if f.lease_failures > 0:
            f.lease_failures -= 1
            raise OSError("store unreachable while recovering (injected)")
        if f.lease_error is not None:
            error, f.lease_error = f.lease_error, None
            raise error
        return await self.inner.high_water() + f.high_water_shift

    async def release(self) -> None:
        await self.inner.release()
        if self.faults.on_release is not None:
            hook, self.faults.on_release = self.faults.on_release, None
            await hook()


class Faults:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error  # None: the held batch is then written
        self.trigger: Callable[[BatchWrite], bool] | None = None
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.down = False  # while True every commit fails as "unreachable"
        self.refused = 0
        self.lease_failures = 0  # the next this-many lease reads fail as "unreachable"
        self.lose_reply = 0  # the next this-many commits are made, then fail as "unreachable"
        self.high_water_shift = 0  # added to the stored mark the lease reads (another writer moved it)
        self.after_commit: BaseException | None = None  # the next commit is made, then fails with this
        self.lease_error: BaseException | None = None  # the next lease read fails with this
        self.on_release: Callable[[], Awaitable[None]] | None = None  # run once after a lease is released
        self.acquire_failures = 0  # the next this-many lease acquisitions fail as "unreachable"


def with_faults(store: Store, faults: Faults) -> Store:
    """``store`` with every writer lease it hands out wrapped in a ``FaultyLease``."""
    real_acquire = store.acquire_writer

    async def acquire_writer(*, wait: bool = False, timeout: float | None = None) -> WriterLease:
        if faults.acquire_failures > 0:
            faults.acquire_failures -= 1
            raise OSError("store unreachable while taking the lease (injected)")
        return FaultyLease(await real_acquire(wait=wait, timeout=timeout), faults)

    store.acquire_writer = acquire_writer  # type: ignore[method-assign]
    return store
