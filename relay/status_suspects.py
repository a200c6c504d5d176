"""Accounts that look inconsistent, for the status self-healing (``relay.status_heal``):
``SuspectQueue`` holds them until their check is due; ``WatchedLanes`` fills it when a ``#commit``
arrives for an account the relay holds inactive upstream (a host that reactivated the account
without an ``#account``, or whose ``#account`` the relay missed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from firehose.lru import BoundedLRU
from firehose.state import AccountState
from relay.ingest.lanes import AccountLanes, Work


class SuspectQueue:
    """Accounts to check soon (``did -> host``), each at most once per ``delay`` seconds; filled by
    ``WatchedLanes``, drained by ``StatusHealer``. At most ``limit`` wait (0: none are kept, the
    self-healing is off)."""

    def __init__(self, delay: float, clock: Callable[[], float] = time.time, limit: int = 100_000) -> None:
        self.delay = delay
        self.clock = clock
        self.limit = limit
        #: did -> (host, due time)
        self._waiting: dict[str, tuple[str, float]] = {}
        #: did -> when it was last handed out (bounded)
        self._checked: BoundedLRU[str, float] = BoundedLRU(max(1, limit))

    def __len__(self) -> int:
        return len(self._waiting)

    def note_commit(self, did: str, hostname: str, held: AccountState | None) -> None:
        """A ``#commit`` arrived from ``hostname`` for ``did``, which the relay holds as ``held``:
        an account held inactive upstream (on that host) that commits is a suspect."""
        if held is None or held.upstream_status == "active" or held.host != hostname:
            return
        self.add(did, hostname)

    def add(self, did: str, hostname: str) -> None:
        if did in self._waiting or len(self._waiting) >= self.limit:
            return
        now = self.clock()
        last = self._checked.peek(did)
        self._waiting[did] = (hostname, now if last is None else max(now, last + self.delay))

    def due(self) -> list[tuple[str, str]]:
        """Take the suspects whose check is due: ``(did, host)``."""
        now = self.clock()
        out = [(did, host) for did, (host, at) in self._waiting.items() if at <= now]
        for did, _ in out:
            del self._waiting[did]
            self._checked.put(did, now)
        return out


class WatchedLanes(AccountLanes):
    """``AccountLanes`` that put an account in ``suspects`` when a ``#commit`` arrives for it while
    the relay holds it inactive upstream (known from the lane in memory)."""

    def __init__(self, *, suspects: SuspectQueue, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suspects = suspects

    def submit(self, work: Work) -> None:
        if work.kind == "#commit":
            self.suspects.note_commit(work.did, work.hostname, self.state(work.did))
        super().submit(work)
