"""Storage-side value types (``HostState``); the protocol types live in ``firehose.state``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Host (upstream PDS or relay) statuses kept by the host manager.
HostStatus = Literal["active", "idle", "offline", "throttled", "banned"]


@dataclass(slots=True)
class HostState:
    """The relay's stored view of one upstream host.

    ``cursor`` is the last upstream ``seq`` whose effects are durable (the value to resume from).
    Rate limits are events per second/hour/day; ``None`` means "use the relay's default".
    ``relay`` and ``lenient`` are operator settings (``relay.hosts.HostManager``).
    ``account_count`` is maintained by the sequencer and ``Store.upsert_account``.
    """

    hostname: str
    status: str = "active"
    cursor: int = 0
    account_limit: int | None = None
    trusted: bool = False
    rate_limit_per_second: int | None = None
    rate_limit_per_hour: int | None = None
    rate_limit_per_day: int | None = None
    last_seen: float | None = None
    account_count: int = 0
    created_at: float = 0.0
    #: another relay (added by an operator), not a PDS (migration 0085; see ARCHITECTURE.md)
    relay: bool = False
    #: judge sync 1.0 commits leniently (True), strictly (False), or per the relay setting (None)
    lenient: bool | None = None
