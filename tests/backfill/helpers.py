"""Event builders shared by the backfill tests and the crash-test child process."""

from __future__ import annotations

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
