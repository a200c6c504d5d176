"""The relay's per-host Prometheus series, kept as plain counters and rendered straight to text.

A relay following thousands of hosts exports a few series per host: frames received by type
(``relay_events_in_total{host,type}``), cursor resets (``relay_host_cursor_resets_total{host,reason}``)
and the accounts held against the host's limit (``relay_host_accounts{host}``,
``relay_host_account_limit{host}``). Built through ``prometheus_client`` (a child object, a lock and
a ``Sample`` per series, every value formatted again at each scrape), 5,000 hosts' series took most
of a second of GIL per scrape, stalling delivery. Here:

* counting is a dict update on the event loop (no lock, no label lookup);
* each host's ``relay_events_in_total`` lines are rendered once per change and kept: a scrape
  re-renders only the hosts that received frames since the last one, and joins the rest;
* the account gauges are rendered once per snapshot (each scrape's refresh replaces it), each
  host's two lines again only when its values changed;
* :meth:`HostSeries.forget` drops every series of a host at once.

Thread safety: the loop mutates, a scrape renders in a worker thread. Rendering copies each dict
(``list(d.items())``, atomic under the GIL for str keys and int values) before reading it, and a
host's cached text is tagged with the change counter it was built from, so an increment landing
during a render is never lost (the text is rebuilt at the next scrape).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HostSeries"]

_EVENTS_HEAD = ("# HELP relay_events_in_total Frames received from upstream hosts\n"
                "# TYPE relay_events_in_total counter\n")
_RESETS_HEAD = ("# HELP relay_host_cursor_resets_total Upstream cursors reset: the host's stream went backwards "
                "or it answered FutureCursor (wiped or restored)\n"
                "# TYPE relay_host_cursor_resets_total counter\n")
_ACCOUNTS_HEAD = ("# HELP relay_host_accounts Accounts the relay holds for each upstream host\n"
                  "# TYPE relay_host_accounts gauge\n")
_LIMIT_HEAD = ("# HELP relay_host_account_limit Account limit of each upstream host that has one\n"
               "# TYPE relay_host_account_limit gauge\n")


def escape(value: str) -> str:
    """A label value as the text format writes it (backslash, newline and double quote escaped)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(n: int) -> str:
    """An integer sample value as ``prometheus_client`` writes it (``3.0``)."""
    return f"{n}.0"


@dataclass(slots=True)
class _Host:
    """One host's counters: its escaped label, frames by type, and a change counter with the
    text last rendered from it."""

    label: str
    counts: dict[str, int] = field(default_factory=dict)
    changes: int = 0
    text: tuple[int, str] | None = None


class HostSeries:
    """Per-host counters and gauges, rendered as Prometheus text (see the module docstring)."""

    def __init__(self) -> None:
        self._hosts: dict[str, _Host] = {}
        self._resets: dict[str, dict[str, int]] = {}
        self._accounts: dict[str, tuple[int, int | None]] = {}
        self._accounts_text: tuple[dict[str, tuple[int, int | None]], str] | None = None
        self._types: dict[str, str] = {}
        #: per host: the account gauges' values and their two lines, as last rendered
        self._account_lines: dict[str, tuple[tuple[int, int | None], str, str]] = {}

    def count_in(self, host: str, kind: str, n: int = 1) -> None:
        """``n`` frames of type ``kind`` received from ``host``. Event-loop code."""
        row = self._hosts.get(host)
        if row is None:
            row = self._hosts[host] = _Host(escape(host))
        row.counts[kind] = row.counts.get(kind, 0) + n
        row.changes += 1

    def count_reset(self, host: str, reason: str) -> None:
        """``host``'s upstream cursor was reset for ``reason``. Event-loop code."""
        reasons = self._resets.setdefault(host, {})
        reasons[reason] = reasons.get(reason, 0) + 1

    def set_accounts(self, accounts: dict[str, tuple[int, int | None]]) -> None:
        """Replace the account gauges: ``{hostname: (accounts, limit or None)}``; only these
        hosts are exported, ``relay_host_account_limit`` only for those with a limit."""
        self._accounts = dict(accounts)

    def forget(self, host: str) -> None:
        """Remove every series of ``host`` (banned or removed). Call it after the host's run
        has stopped: a later count would bring its series back from zero."""
        self._hosts.pop(host, None)
        self._resets.pop(host, None)
        if host in self._accounts:
            self._accounts = {h: v for h, v in self._accounts.items() if h != host}

    def events_in(self) -> dict[str, float]:
        """Frames received per host (all types), for the console. Safe in a worker thread."""
        return {host: float(sum(list(row.counts.values()))) for host, row in list(self._hosts.items())}

    def hosts(self) -> set[str]:
        """The hosts that have a series now."""
        return set(self._hosts) | set(self._resets) | set(self._accounts)

    def render(self) -> str:
        """The four families in the text exposition format. Safe in a worker thread."""
        parts = [_EVENTS_HEAD]
        for row in list(self._hosts.values()):
            cached = row.text
            changes = row.changes
            if cached is None or cached[0] != changes:
                text = "".join(f'relay_events_in_total{{host="{row.label}",type="{self._type(kind)}"}} {number(n)}\n'
                               for kind, n in list(row.counts.items()))
                row.text = cached = (changes, text)
            parts.append(cached[1])
        parts.append(_RESETS_HEAD)
        for host, reasons in list(self._resets.items()):
            label = escape(host)
            parts.extend(f'relay_host_cursor_resets_total{{host="{label}",reason="{escape(reason)}"}} {number(n)}\n'
                         for reason, n in list(reasons.items()))
        parts.append(self._render_accounts())
        return "".join(parts)

    def _type(self, kind: str) -> str:
        found = self._types.get(kind)
        if found is None:
            found = self._types[kind] = escape(kind)
        return found

    def _render_accounts(self) -> str:
        snapshot = self._accounts
        cached = self._accounts_text
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        lines = self._account_lines
        count, limit = [_ACCOUNTS_HEAD], [_LIMIT_HEAD]
        for host, value in sorted(snapshot.items()):
            found = lines.get(host)
            if found is None or found[0] != value:
                label = escape(host)
                n, most = value
                found = lines[host] = (value, f'relay_host_accounts{{host="{label}"}} {number(n)}\n',
                                       "" if most is None else
                                       f'relay_host_account_limit{{host="{label}"}} {number(most)}\n')
            count.append(found[1])
            limit.append(found[2])
        for host in [h for h in lines if h not in snapshot]:
            del lines[host]
        text = "".join(count) + "".join(limit)
        self._accounts_text = (snapshot, text)
        return text
