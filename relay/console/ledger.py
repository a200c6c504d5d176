"""Verdicts per host for the operator console.

``relay_verdicts_total`` counts verdicts by kind and reason for the whole relay (no host label:
thousands of hosts times dozens of reasons would be too many series). The console's host detail
needs them per host, so the service's count callback also feeds a :class:`HostLedger`: a table in
memory of ``host -> (kind, reason) -> count`` for everything but accepted frames, since the
process started. Its size is bounded by the hosts followed times the reasons that exist.
"""

from __future__ import annotations

from collections import Counter


class HostLedger:
    """Counts of non-``accept`` verdicts per host since start (see the module docstring)."""

    def __init__(self) -> None:
        self._hosts: dict[str, Counter[tuple[str, str]]] = {}

    def count(self, host: str | None, kind: str, reason: str) -> None:
        """One verdict of ``kind``/``reason`` on a frame of ``host`` (None or ``accept``: ignored)."""
        if host is None or kind == "accept":
            return
        found = self._hosts.get(host)
        if found is None:
            found = self._hosts[host] = Counter()
        found[(kind, reason)] += 1

    def of(self, host: str) -> list[dict[str, object]]:
        """``host``'s verdicts, most frequent first: ``[{kind, reason, count}]``."""
        found = self._hosts.get(host) or Counter()
        return [{"kind": k, "reason": r, "count": n} for (k, r), n in found.most_common()]

    def totals(self) -> dict[str, int]:
        """Per host, how many rejected (``reject`` kind) frames: for the host table."""
        return {h: sum(n for (k, _), n in c.items() if k == "reject") for h, c in self._hosts.items()}

    def forget(self, host: str) -> None:
        self._hosts.pop(host, None)
