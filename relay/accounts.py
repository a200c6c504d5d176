"""Account status as the relay reports it downstream (pure helpers).

The relay combines the upstream status (from ``#account`` frames) with its own local status
(operator takedowns) and its sync state: a local takedown wins, then the upstream status, then
``throttled`` (held over a host's account limit) and ``desynchronized`` (repair pending).
"""

from __future__ import annotations

from datetime import UTC, datetime

from firehose.state import AccountState

#: Statuses a ``#account`` frame may carry (subscribeRepos lexicon knownValues).
ACCOUNT_STATUSES = ("takendown", "suspended", "deleted", "deactivated", "desynchronized", "throttled")


def now_iso() -> str:
    """Current time as an atproto datetime (UTC, millisecond precision, ``Z``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def reported_status(state: AccountState) -> str:
    """The single status ``getRepoStatus``/``listRepos`` report (``active`` when none applies)."""
    combined = state.combined_status
    if combined != "active":
        return combined
    if state.sync_state == "throttled":
        return "throttled"
    if state.sync_state in ("desynchronized", "resyncing"):
        return "desynchronized"
    return "active"


def redistributable(state: AccountState | None) -> bool:
    """Whether events of this account may be passed downstream (unknown accounts: yes)."""
    return state is None or (state.active and state.sync_state != "throttled")


def account_event_body(state: AccountState) -> dict[str, object]:
    """The ``#account`` body (without ``seq``) for the account's combined status."""
    status = state.combined_status
    body: dict[str, object] = {"did": state.did, "active": status == "active", "time": now_iso()}
    if status != "active":
        body["status"] = status
    return body
