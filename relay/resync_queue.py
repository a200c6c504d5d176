"""The accounts waiting for a resync, and the frames held for them.

Filled by the account lanes (a broken chain, a held account released, a restart's desynchronized
accounts), drained by ``relay.resync.ResyncManager``'s workers. Every DID in the queue has one
``Pending`` entry until a resync of it succeeds: ``queued`` (waiting for a worker), ``running``
or ``waiting`` (a failed attempt's backoff timer runs). Nothing gives up: a failed attempt is
retried after the delay the manager chooses, and ``kick(did)`` (the account's host sent something
new for it) brings a waiting retry forward to now, or to ``kick_floor`` seconds after the last
attempt ended, whichever is later (so a busy account cannot turn a failing PDS into one getRepo
per frame). The entries are what the admin list and the age gauge show.

The queue also keeps the ledger of the bytes the lanes hold for accounts being resynchronised:
at most ``held_per_account`` per DID and ``held_total`` in all (``fits``/``add_held``/
``release_held``); the lanes drop the oldest held frames to stay under it (the resync covers them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

#: Age buckets of the desynchronized-accounts gauge: (label, upper bound in seconds).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (("under_1m", 60.0), ("under_10m", 600.0), ("under_1h", 3600.0),
                                               ("under_1d", 86400.0), ("older", float("inf")))

PendingState = Literal["queued", "running", "waiting"]


@dataclasses.dataclass(slots=True, eq=False)
class Pending:
    """One account waiting for its resync. Times are wall-clock seconds (``clock``)."""

    did: str
    since: float  # when the account was marked desynchronized (as far as this process knows)
    state: PendingState = "queued"
    attempts: int = 0  # failed attempts since ``since``
    last_failure: str | None = None  # the last failed attempt's reason (a metric label)
    last_error: str | None = None  # ... and its message
    last_ended: float | None = None  # when the last attempt ended
    next_retry: float | None = None  # when a waiting entry is queued again
    again: bool = False  # marked desynchronized again while its resync ran: queue it once more
    timer: asyncio.TimerHandle | None = None


class ResyncQueue:
    """See the module docstring. ``enqueue(did)`` is idempotent while the DID is pending."""

    def __init__(self, on_change: Callable[[int], None] | None = None, *,
                 held_per_account: int = 4 * 1024 * 1024, held_total: int = 256 * 1024 * 1024,
                 kick_floor: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        """``on_change(pending)`` is called whenever the number of pending DIDs changes (a gauge)."""
        self._ready: deque[str] = deque()
        self._wakeup: asyncio.Event = asyncio.Event()
        self._pending: dict[str, Pending] = {}
        self._on_change = on_change
        self.held_per_account = held_per_account
        self.held_total = held_total
        self.kick_floor = kick_floor
        self.clock = clock
        self.kicks = 0  # waiting retries brought forward by ``kick``
        self._held: dict[str, int] = {}
        self._held_sum = 0

    # -- the queue -----------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._pending)

    def entry(self, did: str) -> Pending | None:
        return self._pending.get(did)

    def entries(self) -> list[Pending]:
        """Every pending account, the longest desynchronized first."""
        return sorted(self._pending.values(), key=lambda p: (p.since, p.did))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._pending))

    def _ready_now(self, entry: Pending) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.state, entry.next_retry = "queued", None
        self._ready.append(entry.did)
        self._wakeup.set()

    async def enqueue(self, did: str, since: float | None = None) -> None:
        """Queue ``did`` for a resync (marked desynchronized at ``since``, default now). Already
        pending: nothing, except that one running now is queued once more when it ends."""
        self.add(did, since)

    def add(self, did: str, since: float | None = None) -> None:
        """``enqueue`` without awaiting (from synchronous code)."""
        entry = self._pending.get(did)
        if entry is not None:
            if entry.state == "running":
                entry.again = True
            return
        entry = self._pending[did] = Pending(did, self.clock() if since is None else since)
        self._ready_now(entry)
        self._changed()

    def kick(self, did: str) -> bool:
        """The account's host sent something new for ``did`` (it is held or judged while
        desynchronized): a waiting retry starts at once (not before ``kick_floor`` after the last
        attempt). A DID not pending at all is queued (a desynchronized account is never left
        without a resync). True when the retry was brought forward or queued."""
        entry = self._pending.get(did)
        if entry is None:
            self.add(did)
            return True
        if entry.state != "waiting":
            return False
        at = max(self.clock(), (entry.last_ended or 0.0) + self.kick_floor)
        if entry.next_retry is not None and at >= entry.next_retry:
            return False
        self.kicks += 1
        delay = at - self.clock()
        if delay <= 0:
            self._ready_now(entry)
        else:
            self._schedule(entry, delay)
        return True

    def _schedule(self, entry: Pending, delay: float) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        entry.state, entry.next_retry = "waiting", self.clock() + delay
        entry.timer = asyncio.get_running_loop().call_later(delay, self._ready_now, entry)

    async def get(self) -> str:
        """The next DID to resync (its entry is ``running`` until ``succeeded``/``failed``)."""
        while True:
            while self._ready:
                did = self._ready.popleft()
                entry = self._pending.get(did)
                if entry is not None and entry.state == "queued":
                    entry.state = "running"
                    return did
            self._wakeup.clear()
            await self._wakeup.wait()

    def succeeded(self, did: str) -> None:
        """The DID's resync finished (or was not needed any more): it leaves the queue, unless it
        was marked desynchronized again meanwhile (then it is queued again, from now)."""
        entry = self._pending.pop(did, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        if entry is not None and entry.again:
            self.add(did)
        self._changed()

    def discard(self, did: str) -> None:
        """The account was repaired otherwise (an upstream ``#sync``): a queued or waiting entry
        leaves the queue (a running one is settled by its attempt)."""
        entry = self._pending.get(did)
        if entry is not None and entry.state != "running":
            self.succeeded(did)

    def failed(self, did: str, reason: str, error: str, delay: float) -> None:
        """A resync attempt failed: retry in ``delay`` seconds (or sooner, when kicked)."""
        entry = self._pending.get(did)
        if entry is None:
            return
        entry.attempts += 1
        entry.last_failure, entry.last_error = reason, error
        entry.last_ended = self.clock()
        entry.again = False
        self._schedule(entry, delay)

    def close(self) -> None:
        """Cancel every retry timer (shutdown)."""
        for entry in self._pending.values():
            if entry.timer is not None:
                entry.timer.cancel()
                entry.timer = None

    def by_age(self) -> dict[str, int]:
        """Pending accounts per age bucket (``AGE_BUCKETS``): how long each has been desynchronized."""
        now = self.clock()
        counts = dict.fromkeys((label for label, _ in AGE_BUCKETS), 0)
        for entry in self._pending.values():
            age = now - entry.since
            counts[next(label for label, bound in AGE_BUCKETS if age < bound)] += 1
        return counts

    # -- the held-bytes ledger -----------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes held for every account being resynchronised."""
        return self._held_sum

    def held_for(self, did: str) -> int:
        return self._held.get(did, 0)

    def fits(self, did: str, size: int) -> bool:
        """Whether ``size`` more bytes may be held for ``did`` (under both bounds)."""
        return (self._held.get(did, 0) + size <= self.held_per_account
                and self._held_sum + size <= self.held_total)

    def add_held(self, did: str, size: int) -> None:
        self._held[did] = self._held.get(did, 0) + size
        self._held_sum += size

    def release_held(self, did: str, size: int | None = None) -> None:
        """``size`` bytes held for ``did`` are no longer held (None: all of them)."""
        held = self._held.pop(did, 0)
        freed = held if size is None else min(size, held)
        self._held_sum -= freed
        if held - freed > 0:
            self._held[did] = held - freed
