"""Live account-status self-healing: the relay keeps comparing its account statuses with each
host's own answer and repairs a divergence through the account's lane.

A host's status changes travel as ``#account`` events. One that never reaches the relay (a host
that changed an account's status while the relay was disconnected and past its backfill window,
a host that forgot to emit it) leaves the relay holding the wrong status for good: an account
wrongly inactive is not redistributed at all. ``StatusHealer`` closes that gap between the Spark
reconcile's mass runs:

* **sweeps** — every host (PDSes, not relay upstreams, not banned) is listed fully once per
  ``interval`` with ``com.atproto.sync.listRepos`` (pages of ``page_size``), spread over the
  interval. Each listed account the relay holds *on that host* is compared by hosting status
  (``active`` flag, then ``status``). When the listing completed and the relay holds accounts on
  the host that it did not list, each is asked with ``getRepoStatus``: a status answer is compared
  the same way; ``RepoNotFound`` means ``deleted`` only when the account's DID document (fetched
  fresh) still names this host, or the DID itself is gone;
* **suspects** — an account that looks inconsistent is checked with ``getRepoStatus`` within
  ``suspect_delay`` (once per ``suspect_delay`` at most): a ``#commit`` arriving for an account the
  relay holds inactive (``relay.status_suspects``); and after a host's stream
  reconnects, the whole host is swept again (an ``#account`` may have been missed during the gap),
  at most once per ``HealPace.resweep_gap`` (an hour at the default pace).

A divergence becomes a ``backfill.outbox.Repair`` of kind ``#account`` (``base_status``: what the
relay held; ``observed_at``: when the host answered) applied with ``AccountLanes.apply_repair``
once the relay has caught up with the host past ``observed_at`` (``Upstreams.caught_up``): the
same compare-and-set as a Spark repair, so a status the live stream changed meanwhile wins and the
finding is discarded as ``stale``. A finding whose host the relay has not caught up with within
``settle * 3 + 5`` seconds (or whose host's stream is disconnected) is checked again as a suspect.

A host that cannot answer (timeout, connection failure, an error status, a malformed page) is
skipped, counted, and tried again after a capped backoff; a failed or partial listing is never read
as the host no longer hosting its accounts. Every request goes through the SSRF-checked client,
bounded by ``timeout``.

Metrics: ``relay_status_heal_checked_total{source}`` (accounts compared, from ``list`` pages or
``status`` answers), ``relay_status_heal_divergences_total{kind}`` (found; kind = the host's status),
``relay_status_heal_repairs_total{kind,outcome}`` (what the lane did), and
``relay_status_heal_host_failures_total{reason}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from backfill.outbox import Repair, RepairOutcome
from backfill.store import Store
from firehose.state import AccountState
from mst.errors import ReasonError
from relay.hosts import host_base_url
from relay.identity import IdentityError, IdentityResolver
from relay.ingest.hostruns import Upstreams
from relay.ingest.lanes import AccountLanes
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.ssrf import SafeClient
from relay.status_suspects import SuspectQueue

log = logging.getLogger("relay.status_heal")

LIST_PATH = "/xrpc/com.atproto.sync.listRepos"
STATUS_PATH = "/xrpc/com.atproto.sync.getRepoStatus"
#: statuses counted under their own label; any other string a host sends is counted as ``other``
KNOWN_STATUSES = ("active", "deactivated", "takendown", "suspended", "deleted", "desynchronized", "throttled")
#: host statuses that are not swept
SKIPPED_HOSTS = ("banned", "blocked")
MAX_PAGES = 100_000
RETRY_MIN, RETRY_MAX = 60.0, 3600.0
#: settings key (+ hostname) of a host's last full sweep (unix seconds)
LAST_SWEEP_KEY = "status_heal.last_sweep."


class HostUnavailable(ReasonError):
    """A host did not give a usable answer; ``reason`` is a fixed snake_case label."""


@dataclasses.dataclass(frozen=True, slots=True)
class HealPace:
    """How often the healer looks (seconds)."""

    #: every host is listed fully once per interval
    interval: float = 24 * 3600.0
    #: a suspect account is checked this soon, and not again sooner
    suspect_delay: float = 300.0
    #: accounts per listRepos page (the lexicon's maximum is 1000)
    page_size: int = 1000
    #: per request
    timeout: float = 10.0
    #: the margin of ``Upstreams.caught_up`` (the relay's ``repair_settle``)
    settle: float = 10.0

    @property
    def resweep_gap(self) -> float:
        """A host whose stream reconnects is swept again, at most once per this long (a 24th of
        the interval, at least ``suspect_delay``): a host reconnecting all the time costs at most
        25 sweeps a day instead of one."""
        return max(self.suspect_delay, self.interval / 24)


def hosting_status(answer: dict[str, Any]) -> str:
    """The hosting status a ``listRepos`` entry or a ``getRepoStatus`` answer reports (``active``
    defaults to true; an inactive account without a status is ``deactivated``)."""
    if answer.get("active", True) is not False:
        return "active"
    status = answer.get("status")
    return status if isinstance(status, str) and status else "deactivated"


def status_label(status: str) -> str:
    return status if status in KNOWN_STATUSES else "other"


def divergence(host: str, did: str, reported: str, stored: AccountState | None,
               observed_at: float) -> Repair | None:
    """The ``#account`` repair that would make the relay hold ``reported`` for ``did`` (pure), or
    None when there is nothing to repair: the relay does not hold the account, holds it on another
    host (it follows moves through ``#identity``), holds it as throttled (held accounts emit
    nothing), or already holds that status."""
    if stored is None or stored.host != host or stored.sync_state == "throttled":
        return None
    if stored.upstream_status == reported:
        return None
    active = reported == "active"
    return Repair(id=0, kind="#account", did=did, host=host, active=active,
                  status=None if active else reported, base_status=stored.upstream_status,
                  observed_at=observed_at)


def names_host(pds: str | None, hostname: str) -> bool:
    """Does a DID document's PDS endpoint name ``hostname`` (``host`` or ``host:port``)?"""
    if not pds:
        return False
    try:
        netloc = urlsplit(pds).netloc.lower()
    except ValueError:
        return False
    if netloc == hostname.lower():
        return True
    return netloc.rsplit(":", 1)[0] == hostname.lower() and netloc.endswith((":443", ":80"))


class StatusHealer:
    """See the module docstring. ``run()`` is the background task; ``sweep_host`` and
    ``check_account`` do one check each (tests and operators)."""

    def __init__(self, *, store: Store, lanes: AccountLanes, upstreams: Upstreams, safe: SafeClient,
                 identity: IdentityResolver, metrics: RelayMetrics, pace: HealPace, suspects: SuspectQueue,
                 insecure: bool = False,
                 clock: Callable[[], float] = time.time, tick: float = 1.0) -> None:
        self.store = store
        self.lanes = lanes
        self.upstreams = upstreams
        self.safe = safe
        self.identity = identity
        self.metrics = metrics
        self.pace = pace
        self.insecure = insecure
        self.clock = clock
        self.tick = max(0.05, min(tick, pace.interval / 10, pace.suspect_delay / 2))
        #: seconds between passes over every host (suspects are checked every tick): a pass costs
        #: a few µs per host, and a reconnect is found by its connection count, so none is missed
        self.host_every = max(self.tick, min(5.0, pace.settle))
        self._hosts_at = float("-inf")
        #: hostname -> the host run's connection count at the last pass
        self._connections: dict[str, int] = {}
        #: hostname -> monotonic time of its next sweep
        self._due: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._last_sweep: dict[str, float] = {}
        #: hostname -> whether its stream was connected at the last step (a reconnect is False then True)
        self.seen_connected: dict[str, bool] = {}
        self.suspects = suspects
        #: sweeps finished, per host (tests synchronise on it)
        self.sweeps: dict[str, int] = {}

    # -- signals ---------------------------------------------------------------------------------
    def suspect(self, did: str, hostname: str) -> None:
        """Check ``did`` on ``hostname`` within ``suspect_delay`` (not twice within it)."""
        self.suspects.add(did, hostname)

    # -- the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: sweep the hosts that are due, check the suspects that are due. Never raises
        (store errors are logged and retried on the next tick)."""
        while True:
            try:
                now = time.monotonic()
                hosts = now - self._hosts_at >= self.host_every
                if hosts:
                    self._hosts_at = now
                await self.step(hosts=hosts)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("status healing step failed")
            await asyncio.sleep(self.tick)

    async def step(self, *, hosts: bool = True) -> None:
        """One pass: learn the hosts, sweep every one that is due (``hosts``), check the due suspects."""
        now = self.clock()
        for name in await self._hosts() if hosts else ():
            if name not in self._due:
                self._due[name] = await self._first_due(name, now)
            connected = self.upstreams.connected(name)
            seen = self.seen_connected.get(name)
            count = self.upstreams.connections(name)
            # a reconnect (#account may be missed): seen disconnected, or connected again since the last pass
            again = seen is False or (seen is True and count > self._connections.get(name, count))
            self._connections[name] = count
            if connected and again:
                last = self._last_sweep.get(name, float("-inf"))
                self._due[name] = min(self._due[name], max(now + self.pace.settle, last + self.pace.resweep_gap))
            self.seen_connected[name] = connected
            if self._due[name] <= self.clock():
                await self.sweep_host(name)
        for did, hostname in self.suspects.due():
            try:
                await self.check_account(did, hostname)
            except HostUnavailable:
                pass  # counted; a suspect again

    async def _first_due(self, hostname: str, now: float) -> float:
        """One interval after the host's last full sweep (kept in the store's settings, so a restart
        does not postpone it); for a host never swept, a point of the interval fixed by its name
        (the hosts' sweeps spread evenly)."""
        raw = await self.store.get_setting(LAST_SWEEP_KEY + hostname)
        try:
            last = float(raw) if raw else None
        except ValueError:
            last = None
        if last is not None:
            return last + self.pace.interval
        return now + self.pace.interval * ((zlib.crc32(hostname.encode()) % 1000) / 1000.0)

    async def _hosts(self) -> list[str]:
        """The PDS hosts to sweep, from the host board (``relay.hosts.HostBoard``, in memory: a
        tick reads no host rows)."""
        board = self.upstreams.board
        await board.ensure_loaded()
        return board.hostnames(skip=SKIPPED_HOSTS, relays=False)

    def _failed(self, hostname: str, reason: str) -> None:
        self.metrics.child(self.metrics.heal_host_failures, reason).inc()
        n = self._failures[hostname] = self._failures.get(hostname, 0) + 1
        delay = min(RETRY_MAX, RETRY_MIN * 2 ** (n - 1), self.pace.interval)
        self._due[hostname] = self.clock() + delay
        log.info("status check: host did not answer; retried later",
                 extra=fields(host=hostname, reason=reason, retry_in=delay))

    # -- requests ----------------------------------------------------------------------------------
    async def _get(self, hostname: str, path: str, params: dict[str, str],
                   max_bytes: int) -> tuple[int, dict[str, Any]]:
        url = host_base_url(hostname, insecure=self.insecure) + path
        try:
            status, body, _ = await asyncio.wait_for(self.safe.get(url, params=params, max_bytes=max_bytes),
                                                     self.pace.timeout)
        except TimeoutError:
            raise HostUnavailable("timeout") from None
        except Exception as exc:  # SSRF refusal, connection failure, oversized body
            raise HostUnavailable(str(getattr(exc, "reason", "") or "unreachable")) from exc
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise HostUnavailable("bad_answer" if status == 200 else f"http_{status // 100}xx")
        return status, value

    # -- sweeps ------------------------------------------------------------------------------------
    async def sweep_host(self, hostname: str) -> bool:
        """List ``hostname`` fully, compare, repair; then ask about the accounts it did not list.
        Returns False (and schedules a retry) when the host could not answer."""
        listed: set[str] = set()
        held_here = 0  # listed accounts the relay holds on this host
        cursor = ""
        try:
            for _ in range(MAX_PAGES):
                params = {"limit": str(self.pace.page_size)}
                if cursor:
                    params["cursor"] = cursor
                status, page = await self._get(hostname, LIST_PATH, params, 64 * 1024 * 1024)
                if status != 200 or not isinstance(page.get("repos"), list):
                    raise HostUnavailable("bad_answer" if status == 200 else f"http_{status // 100}xx")
                observed_at = time.time()
                entries = [e for e in page["repos"] if isinstance(e, dict) and isinstance(e.get("did"), str)
                           and e["did"] not in listed]
                listed.update(e["did"] for e in entries)
                stored = await self.store.get_accounts([e["did"] for e in entries])
                held_here += sum(1 for a in stored.values() if a.host == hostname)
                self.metrics.child(self.metrics.heal_checked, "list").inc(len(entries))
                repairs = [divergence(hostname, e["did"], hosting_status(e), stored.get(e["did"]), observed_at)
                           for e in entries]
                await self._repair(hostname, [r for r in repairs if r is not None], observed_at)
                next_cursor = page.get("cursor")
                if not entries or not isinstance(next_cursor, str) or not next_cursor or next_cursor == cursor:
                    break
                cursor = next_cursor
            for did in await self._unlisted(hostname, listed, held_here):
                await self.check_account(did, hostname)
        except HostUnavailable as exc:
            self._failed(hostname, exc.reason)
            return False
        self._failures.pop(hostname, None)
        self._last_sweep[hostname] = self.clock()
        await self.store.set_setting(LAST_SWEEP_KEY + hostname, repr(self._last_sweep[hostname]))
        self._due[hostname] = self.clock() + self.pace.interval
        self.sweeps[hostname] = self.sweeps.get(hostname, 0) + 1
        return True

    async def _unlisted(self, hostname: str, listed: set[str], held_here: int) -> list[str]:
        """Accounts the relay holds on ``hostname`` (not as deleted) that its listing left out.
        The account table is scanned only when the relay holds more accounts there than the
        ``held_here`` it found in the listing (accounts kept as deleted count: once a host has
        deleted accounts, each sweep of it scans the table)."""
        if await self.store.count_accounts(hostname) <= held_here:
            return []
        out: list[str] = []
        after: str | None = None
        while True:
            page = await self.store.list_accounts(after_did=after, limit=1000)
            out += [a.did for a in page if a.host == hostname and a.did not in listed
                    and a.upstream_status != "deleted" and a.sync_state != "throttled"]
            if len(page) < 1000:
                return out
            after = page[-1].did

    async def check_account(self, did: str, hostname: str) -> bool:
        """Ask ``hostname`` for ``did``'s status (``getRepoStatus``), compare, repair. Raises
        ``HostUnavailable`` from a sweep; as a suspect check, a host that cannot answer makes the
        account a suspect again. Returns whether a repair was applied."""
        try:
            status, answer = await self._get(hostname, STATUS_PATH, {"did": did}, 1 << 16)
        except HostUnavailable as exc:
            self.metrics.child(self.metrics.heal_host_failures, exc.reason).inc()
            self.suspect(did, hostname)
            raise
        observed_at = time.time()
        if status == 200:
            reported = hosting_status(answer)
        elif status == 400 and answer.get("error") == "RepoNotFound":
            if not await self._gone(did, hostname):
                return False
            reported = "deleted"
        else:
            self.metrics.child(self.metrics.heal_host_failures, f"http_{status // 100}xx").inc()
            self.suspect(did, hostname)
            return False
        self.metrics.child(self.metrics.heal_checked, "status").inc()
        stored = (await self.store.get_accounts([did])).get(did)
        repair = divergence(hostname, did, reported, stored, observed_at)
        if repair is None:
            return False
        return await self._repair(hostname, [repair], observed_at) > 0

    async def _gone(self, did: str, hostname: str) -> bool:
        """A host answered ``RepoNotFound``: deleted only if the DID is gone or still names the host."""
        try:
            ident = await self.identity.resolve(did, fresh=True)
        except IdentityError as exc:
            return exc.reason == "did_not_found"
        return names_host(ident.pds, hostname)

    async def _repair(self, hostname: str, repairs: Iterable[Repair], observed_at: float) -> int:
        """Apply the findings of one answer in their lanes once the relay has caught up with the
        host past ``observed_at``; a finding that cannot wait is checked again as a suspect.
        Returns how many were applied."""
        repairs = list(repairs)
        if not repairs:
            return 0
        for r in repairs:
            self.metrics.child(self.metrics.heal_divergences, status_label(r.upstream_status)).inc()
        deadline = self.clock() + self.pace.settle * 3 + 5
        while not self.upstreams.caught_up(hostname, observed_at, self.pace.settle):
            if self.clock() > deadline or not self.upstreams.connected(hostname):
                for r in repairs:
                    self.suspect(r.did, hostname)
                return 0
            await asyncio.sleep(min(0.25, self.pace.settle / 4 or 0.05))
        applied = 0
        for r in repairs:
            outcome, _seq = await self.lanes.apply_repair(r)
            self.metrics.child(self.metrics.heal_repairs, status_label(r.upstream_status), outcome.value).inc()
            if outcome == RepairOutcome.APPLIED:
                applied += 1
                log.info("account status healed", extra=fields(did=r.did, host=hostname, status=r.upstream_status,
                                                               was=r.base_status))
        return applied
