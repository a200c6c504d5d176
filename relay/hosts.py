"""Upstream hosts: requestCrawl admission, admin host operations, statuses and account limits.

Admission of a public ``requestCrawl`` (in this order; each refusal has a snake_case reason):
the client's rate limit (``crawl_client_wait``, checked by ``relay.request_guard`` before the
body is read: 429 with Retry-After) → crawling enabled → hostname syntax
(``relay.ssrf.normalize_hostname``) → domain bans (every parent suffix) → already known (banned →
``HostBanned``; otherwise resubscribe) → new-hosts-per-day limit → every resolved address public
(unless insecure) → ``describeServer`` probe (SSRF-checked, redirects re-checked; an answer naming a
relay, ``Server: atproto-relay``, is refused ``host_is_relay``) → stored as ``active`` and a
subscriber is started.

The new-hosts-per-day limit is exact under concurrency: a request reserves its place (under a
lock: hosts recorded in the last 24 h plus places reserved < the limit) before it resolves and
probes the host; the place is released when the probe fails, and turned into a recorded
admission (under the same lock, so no count sees it twice) when the host is stored. Only this
process admits hosts (the ingest holding the writer lease), so the in-memory reservations are
the whole picture.

Host statuses and their transitions (``com.atproto.sync.defs#hostStatus``):

* ``active``    — subscribed and connected (set on admission, unblock, and every successful connect);
* ``idle``      — connected but no frames for ``idle_after`` seconds (back to active on a frame);
* ``offline``   — the connection keeps failing (``offline_after`` consecutive failures); the
                  subscriber keeps retrying with backoff and a connect makes it active again;
* ``throttled`` — more accounts than the host's limit: the extra accounts are held (not dropped)
                  as ``throttled`` and resynchronized when the limit is raised;
* ``banned``    — blocked by an operator or a domain ban: no subscriber, ``requestCrawl`` refused.

Account limits: trusted domains (``RELAY_TRUSTED_DOMAINS``, suffix match) and hosts marked
trusted are unlimited; others get their own ``account_limit`` or ``RELAY_DEFAULT_ACCOUNT_LIMIT``.

Relay upstreams: an operator may add a host as a relay (``add_host(relay=True)``; probed with
``listHosts`` instead of ``describeServer``; never through public ``requestCrawl``). A relay carries
the accounts of many PDSes (which ones it may speak for: ``relay.ingest.admission``), so it has no account
or event rate limit. Lenient validation of sync 1.0 commits is set per host (``set_validation``:
on, off, or as ``RELAY_LENIENT_SYNC_VALIDATION`` says), stored with the host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import httpx

from backfill.store import Store
from backfill.types import HostState
from mst.errors import ReasonError
from relay.client_limits import ClientRateLimiter
from relay.config import RelayConfig
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.siblings import SERVER_NAME, is_relay_server
from relay.ssrf import AddressGuard, SafeClient, SSRFError, normalize_hostname, split_host_port

log = logging.getLogger("relay.hosts")

HOST_STATUSES = ("active", "idle", "offline", "throttled", "banned")


class CrawlRefused(ReasonError):
    """``requestCrawl``/add refused. ``reason`` is snake_case; ``xrpc_error`` the Lexicon name;
    ``str(exc)`` is the message alone."""

    show_reason = False

    def __init__(self, reason: str, message: str, xrpc_error: str = "InvalidRequest") -> None:
        super().__init__(reason, message)
        self.xrpc_error = xrpc_error


def domain_suffixes(hostname: str) -> list[str]:
    """``a.b.example.com:443`` → ``[a.b.example.com, b.example.com, example.com, com]``."""
    name, _ = split_host_port(hostname)
    labels = name.lower().rstrip(".").split(".")
    return [".".join(labels[i:]) for i in range(len(labels))]


def matches_domain(hostname: str, domains: set[str] | tuple[str, ...] | list[str]) -> bool:
    """True when ``hostname`` or any parent domain of it is in ``domains``."""
    wanted = {d.lower().strip(".") for d in domains}
    return any(s in wanted for s in domain_suffixes(hostname))


def host_base_url(hostname: str, *, insecure: bool, websocket: bool = False) -> str:
    """The URL of a host: https/wss, or http/ws for ``host:port``/IP/localhost in insecure mode."""
    name, port = split_host_port(hostname)
    plain = insecure and (port is not None or name in ("localhost",) or name.replace(".", "").isdigit()
                          or ":" in name)
    if websocket:
        return f"{'ws' if plain else 'wss'}://{hostname}"
    return f"{'http' if plain else 'https'}://{hostname}"


StartHost = Callable[[HostState], Awaitable[None]]
StopHost = Callable[[str], Awaitable[None]]
LimitRaised = Callable[[str], Awaitable[None]]


class HostPolicy:
    """Per-host limits derived from the configuration and the host's stored settings (pure)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config

    def is_trusted(self, host: HostState) -> bool:
        """No account or rate limit: marked trusted, under a trusted domain, or a relay upstream."""
        return host.trusted or host.relay or matches_domain(host.hostname, self.config.trusted_domains)

    def account_limit(self, host: HostState) -> int | None:
        """Accounts allowed on ``host`` (None = unlimited)."""
        if self.is_trusted(host):
            return None
        return host.account_limit if host.account_limit is not None else self.config.default_account_limit


@dataclass(slots=True)
class _BoardRow:
    status: str
    accounts: int
    limit: int | None
    relay: bool = False


class HostBoard:
    """The host rows' statuses and account counts, held in memory: what the host gauges
    (``relay_hosts{status}``, ``relay_host_accounts``, ``relay_host_account_limit``) export and what
    the status watch compares with, so neither a scrape nor a housekeeping tick reads the store.

    Contract: this process is the only writer of host rows (the ingest holding the writer lease),
    and every write that changes what the board holds tells it — a status change goes through
    :meth:`set_status`, a stored host row through :meth:`stored`, and the sequencer reports each
    committed batch's account-count changes to :meth:`add_accounts`. The board is read from the
    store once (:meth:`ensure_loaded`, before ingest starts); after that it is exact as long as the
    contract holds. A host the store holds but the board has not seen (written behind its back,
    e.g. by a test) joins it at the next :meth:`stored`."""

    def __init__(self, store: Store, policy: HostPolicy) -> None:
        self.store = store
        self.policy = policy
        self._rows: dict[str, _BoardRow] = {}
        self._counts: dict[str, int] = dict.fromkeys(HOST_STATUSES, 0)
        self._loaded = False
        self._load_lock = asyncio.Lock()
        #: bumped on every change of an account gauge's value; :meth:`publish` rebuilds only then
        self._version = 0
        self._published = -1

    async def ensure_loaded(self) -> None:
        """Read every host row once (paged); later calls return at once. Rows the board already
        holds (told about while loading) are kept as they are."""
        if self._loaded:
            return
        async with self._load_lock:
            if self._loaded:
                return
            after: str | None = None
            while True:
                page = await self.store.list_hosts(after=after, limit=500)
                for host in page:
                    if host.hostname not in self._rows:
                        self._add(host.hostname, host.status, host.account_count, self.policy.account_limit(host),
                                  host.relay)
                if len(page) < 500:
                    break
                after = page[-1].hostname
            self._loaded = True

    def _add(self, hostname: str, status: str, accounts: int, limit: int | None, relay: bool = False) -> _BoardRow:
        row = self._rows[hostname] = _BoardRow(status, accounts, limit, relay)
        self._counts[status] = self._counts.get(status, 0) + 1
        self._version += 1
        return row

    def _set(self, row: _BoardRow, status: str) -> None:
        if row.status != status:
            self._counts[row.status] -= 1
            self._counts[status] = self._counts.get(status, 0) + 1
            if "banned" in (row.status, status):  # banned hosts have no account gauges
                self._version += 1
            row.status = status

    def status(self, hostname: str) -> str | None:
        """The host's status as stored, or None for a host the board does not hold."""
        row = self._rows.get(hostname)
        return None if row is None else row.status

    async def set_status(self, hostname: str, status: str) -> bool:
        """Store ``hostname``'s new status and hold it; False (nothing changed) when the store has
        no such host. The one way host statuses change."""
        changed = await self.store.set_host_status(hostname, status)
        if changed:
            row = self._rows.get(hostname)
            if row is None:
                stored = await self.store.get_host(hostname)
                if stored is not None:
                    self.stored(stored)
            else:
                self._set(row, status)
        return changed

    def stored(self, host: HostState) -> None:
        """``host`` as just written (``Store.upsert_host``) or read from the store: its status and
        limit are taken; its account count only when the board does not hold the host yet (an
        upsert never changes a stored count; the sequencer's deltas keep it)."""
        limit = self.policy.account_limit(host)
        row = self._rows.get(host.hostname)
        if row is None:
            self._add(host.hostname, host.status, host.account_count, limit, host.relay)
            return
        self._set(row, host.status)
        row.relay = host.relay
        if row.limit != limit:
            row.limit = limit
            self._version += 1

    def add_accounts(self, deltas: Mapping[str, int]) -> None:
        """A committed batch changed these hosts' account counts (``BatchWrite.host_updates``). A
        host the board does not hold was created by that batch (as the store does: ``active``,
        no settings)."""
        for hostname, delta in deltas.items():
            if not delta:
                continue
            row = self._rows.get(hostname)
            if row is None:
                self._add(hostname, "active", delta, self.policy.account_limit(HostState(hostname=hostname)))
            else:
                row.accounts += delta
                self._version += 1

    def hostnames(self, *, skip: tuple[str, ...] = (), relays: bool = True) -> list[str]:
        """The hosts held, but those whose status is in ``skip`` (and relay upstreams unless ``relays``)."""
        return [h for h, r in self._rows.items() if r.status not in skip and (relays or not r.relay)]

    def counts(self) -> dict[str, int]:
        """Hosts per status (every status of ``HOST_STATUSES``, zero included)."""
        return dict(self._counts)

    def accounts(self) -> dict[str, tuple[int, int | None]]:
        """``{hostname: (accounts, limit or None)}`` of every host not banned."""
        return {h: (r.accounts, r.limit) for h, r in self._rows.items() if r.status != "banned"}

    def publish(self, metrics: RelayMetrics) -> None:
        """Set the host gauges from memory (no store access). The per-host account snapshot is
        rebuilt only when a value in it changed since the last call."""
        for status, n in self._counts.items():
            metrics.hosts.labels(status=status).set(n)
        if self._published != self._version:
            self._published = self._version
            metrics.set_host_accounts(self.accounts())


class HostManager:
    """Admits, lists and changes hosts; asks the ingest side to start/stop subscribers
    (``start_host``/``stop_host``) and the resync side to release held accounts (``limit_raised``)."""

    def __init__(self, *, store: Store, config: RelayConfig, metrics: RelayMetrics, guard: AddressGuard,
                 safe: SafeClient, start_host: StartHost | None = None, stop_host: StopHost | None = None,
                 limit_raised: LimitRaised | None = None, board: HostBoard) -> None:
        """``board``: the host rows' statuses and account counts in memory, shared with the ingest
        side (``Admission``, ``Upstreams``): one board per process; its policy is this manager's."""
        self.store = store
        self.config = config
        self.policy = board.policy
        #: the host rows' statuses and account counts in memory (shared with the ingest side)
        self.board = board
        self.metrics = metrics
        self.guard = guard
        self.safe = safe
        self.start_host = start_host
        self.stop_host = stop_host
        self.limit_raised = limit_raised
        self.crawling_enabled = config.crawling_enabled
        #: where ``crawling_enabled`` came from: "config" or "admin" (see :meth:`load_settings`)
        self.crawling_source = "config"
        #: requestCrawl calls per client address (``crawl_client_wait``)
        self.crawl_clients = ClientRateLimiter(config.crawl_requests_per_minute)
        #: new-host places reserved by public requestCrawls still probing (see the module docstring)
        self._reserved = 0
        self._admissions = asyncio.Lock()

    async def load_settings(self) -> None:
        """Restore the public-crawling switch. An admin's ``/admin/subs/setEnabled`` survives
        restarts; a *changed* ``RELAY_CRAWLING`` (differing from the value seen at the previous
        start) is the newer decision and wins over it."""
        configured = "true" if self.config.crawling_enabled else "false"
        stored = await self.store.get_setting("crawling_enabled")
        previous = await self.store.get_setting("crawling_configured")
        if stored is not None and previous == configured:
            self.crawling_enabled = stored == "true"
            self.crawling_source = "admin" if stored != configured else "config"
        else:
            self.crawling_enabled = self.config.crawling_enabled
            self.crawling_source = "config"
            await self.store.set_setting("crawling_enabled", configured)
        await self.store.set_setting("crawling_configured", configured)
        log.info("public crawling", extra=fields(enabled=self.crawling_enabled, source=self.crawling_source))

    # -- policy ---------------------------------------------------------------------------
    def is_trusted(self, host: HostState) -> bool:
        return self.policy.is_trusted(host)

    def account_limit(self, host: HostState) -> int | None:
        """Accounts allowed on ``host`` (None = unlimited)."""
        return self.policy.account_limit(host)

    async def is_domain_banned(self, hostname: str) -> bool:
        return matches_domain(hostname, await self.store.list_domain_bans())

    async def record_action(self, action: str, target: str, **detail: object) -> None:
        """Log an admin action and append it to the stored audit trail (``/admin/audit``)."""
        text = json.dumps(detail, default=str)
        log.info("admin action", extra=fields(action=action, target=target, detail=text))
        await self.store.record_admin_action(time.time(), action, target, text)

    # -- admission ------------------------------------------------------------------------
    def crawl_client_wait(self, client: str) -> float:
        """Spend one of ``client``'s requestCrawl tokens: 0.0, or the seconds it must wait (the
        call is then refused, counted ``rate_limited`` and logged)."""
        wait = self.crawl_clients.take(client)
        if wait:
            self.metrics.crawl_requests.labels(result="rate_limited").inc()
            log.info("requestCrawl refused", extra=fields(client=client, reason="rate_limited",
                                                          retry_after=round(wait, 1)))
        return wait

    async def request_crawl(self, raw_hostname: str) -> HostState:
        """Public ``requestCrawl``. Raises ``CrawlRefused``."""
        try:
            host = await self._admit(raw_hostname, public=True)
        except CrawlRefused as exc:
            self.metrics.crawl_requests.labels(result=exc.reason).inc()
            log.info("requestCrawl refused", extra=fields(hostname=raw_hostname[:300], reason=exc.reason))
            raise
        self.metrics.crawl_requests.labels(result="accepted").inc()
        return host

    async def add_host(self, raw_hostname: str, *, account_limit: int | None = None,
                       trusted: bool = False, relay: bool = False) -> HostState:
        """Operator add: skips the crawling switch and the daily limit, not the safety checks.
        ``relay``: the host is another relay (an existing host is changed into one)."""
        host = await self._admit(raw_hostname, public=False, account_limit=account_limit, trusted=trusted,
                                 relay=relay)
        await self.record_action("add_host", host.hostname, account_limit=account_limit, trusted=trusted,
                                 relay=relay)
        return host

    async def _admit(self, raw_hostname: str, *, public: bool, account_limit: int | None = None,
                     trusted: bool = False, relay: bool = False) -> HostState:
        if public and not self.crawling_enabled:
            raise CrawlRefused("crawling_disabled", "this relay is not accepting new hosts right now")
        insecure = self.config.allow_insecure_hosts
        try:
            hostname = normalize_hostname(raw_hostname, allow_insecure=insecure)
        except SSRFError as exc:
            raise CrawlRefused(exc.reason, str(exc)) from None
        if await self.is_domain_banned(hostname):
            raise CrawlRefused("domain_banned", f"{hostname} is banned", "HostBanned")
        existing = await self.store.get_host(hostname)
        if existing is not None:
            if existing.status == "banned":
                raise CrawlRefused("host_banned", f"{hostname} is banned", "HostBanned")
            if not public:
                changed = False
                if account_limit is not None and existing.account_limit != account_limit:
                    existing.account_limit, changed = account_limit, True
                if trusted and not existing.trusted:
                    existing.trusted, changed = True, True
                if relay and not existing.relay:
                    existing.relay, changed = True, True
                if changed:
                    await self.store.upsert_host(existing)
                    self.board.stored(existing)
                    if self.stop_host is not None:  # its run picks the new settings up
                        await self.stop_host(existing.hostname)
            if self.start_host is not None:
                await self.start_host(existing)
            return existing
        if public:
            await self._reserve_new_host()
        try:
            name, _ = split_host_port(hostname)
            try:
                await self.guard.check_host(name)
            except SSRFError as exc:
                raise CrawlRefused(exc.reason, str(exc)) from None
            await self._probe(hostname, relay=relay)
            host = HostState(hostname=hostname, status="active", account_limit=account_limit, trusted=trusted,
                             created_at=time.time(), relay=relay)
            await self.store.upsert_host(host)
        except BaseException:
            if public:
                self._reserved -= 1  # the place is free again
            raise
        if public:
            async with self._admissions:  # reserved -> recorded, never counted twice
                try:
                    await self.store.record_crawl_admission(hostname, time.time())
                finally:
                    self._reserved -= 1
        log.info("host added", extra=fields(hostname=hostname, public=public, relay=relay))
        stored = await self.store.get_host(hostname) or host
        self.board.stored(stored)
        if self.start_host is not None:
            await self.start_host(stored)
        return stored

    async def _reserve_new_host(self) -> None:
        """Reserve one of today's new-host places, or refuse (``new_host_limit``)."""
        async with self._admissions:
            admitted = await self.store.count_crawl_admissions(time.time() - 86400)
            if admitted + self._reserved >= self.config.new_hosts_per_day:
                raise CrawlRefused("new_host_limit", "too many new hosts today; try again later")
            self._reserved += 1

    async def _probe(self, hostname: str, *, relay: bool = False) -> None:
        """``describeServer`` must answer 200 with a JSON object naming the server's DID; a relay
        (which has no server DID) must answer ``listHosts`` with a JSON object listing hosts. A host
        probed as a PDS whose answer names a relay (``Server: atproto-relay``, whatever the status)
        is refused ``host_is_relay``: only an operator subscribes to a relay (``relay=True``)."""
        url = host_base_url(hostname, insecure=self.config.allow_insecure_hosts)
        method = "com.atproto.sync.listHosts?limit=1" if relay else "com.atproto.server.describeServer"
        try:
            status, body, headers = await self.safe.get(f"{url}/xrpc/{method}", max_bytes=256 * 1024)
        except SSRFError as exc:
            raise CrawlRefused(exc.reason, f"describeServer: {exc}") from None
        except httpx.HTTPError as exc:
            raise CrawlRefused("host_unreachable", f"describeServer failed: {type(exc).__name__}") from None
        name = method.partition("?")[0].rpartition(".")[2]
        if not relay and is_relay_server(headers):
            raise CrawlRefused("host_is_relay", f"{hostname} answers as a relay (Server: {SERVER_NAME}); an operator "
                                                f"may add it as a relay upstream")
        if status != 200:
            raise CrawlRefused("describe_server_failed", f"{name} answered HTTP {status}")
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("hosts" if relay else "did"), list if relay else str):
            raise CrawlRefused("describe_server_failed", f"{name} did not answer as a "
                                                         f"{'relay' if relay else 'PDS'} does")

    # -- operator changes -----------------------------------------------------------------
    async def _require(self, hostname: str) -> HostState:
        host = await self.store.get_host(hostname.lower())
        if host is None:
            raise KeyError(hostname)
        return host

    async def block(self, hostname: str) -> HostState:
        host = await self._require(hostname)
        await self.board.set_status(host.hostname, "banned")
        if self.stop_host is not None:
            await self.stop_host(host.hostname)
        self.metrics.forget_host(host.hostname)
        await self.record_action("block_host", host.hostname)
        return await self._require(host.hostname)

    async def unblock(self, hostname: str) -> HostState:
        host = await self._require(hostname)
        await self.board.set_status(host.hostname, "active")
        await self.record_action("unblock_host", host.hostname)
        host = await self._require(host.hostname)
        if self.start_host is not None:
            await self.start_host(host)
        return host

    async def set_limits(self, hostname: str, *, account_limit: int | None = None,
                         trusted: bool | None = None, rate_limits: dict[str, int] | None = None) -> HostState:
        """Change a host's account limit / trust / event rate limits (``per_second``,
        ``per_hour``, ``per_day``). Raising the account limit releases throttled accounts; new
        rate limits apply from the host's next connection (it is reconnected now)."""
        host = await self._require(hostname)
        before = self.account_limit(host)
        if account_limit is not None:
            host.account_limit = account_limit
        if trusted is not None:
            host.trusted = trusted
        rate_limits = rate_limits or {}
        for window, value in rate_limits.items():
            setattr(host, f"rate_limit_{window}", value)
        await self.store.upsert_host(host)
        self.board.stored(host)
        after = self.account_limit(host)
        await self.record_action("set_limits", host.hostname, account_limit=account_limit, trusted=trusted, **rate_limits)
        if (rate_limits or trusted is not None) and host.status != "banned" and self.stop_host and self.start_host:
            await self.stop_host(host.hostname)
            await self.start_host(await self._require(host.hostname))
        raised = after is None or (before is not None and after > before)
        if raised and self.limit_raised is not None:
            await self.limit_raised(host.hostname)
        return await self._require(host.hostname)

    async def set_validation(self, hostname: str, lenient: bool | None) -> HostState:
        """Judge the host's sync 1.0 commits leniently (True), strictly (False), or as the relay
        setting says (None); stored with the host, applied from its next connection (now)."""
        host = await self._require(hostname)
        host.lenient = lenient
        await self.store.upsert_host(host)
        self.board.stored(host)
        await self.record_action("set_validation", host.hostname, lenient=lenient)
        if host.status != "banned" and self.stop_host and self.start_host:
            await self.stop_host(host.hostname)
            await self.start_host(await self._require(host.hostname))
        return await self._require(host.hostname)

    async def reset_cursor(self, hostname: str, cursor: int = 0) -> HostState:
        host = await self._require(hostname)
        if self.stop_host is not None:
            await self.stop_host(host.hostname)
        await self.store.set_host_cursor(host.hostname, cursor)
        await self.record_action("reset_cursor", host.hostname, cursor=cursor)
        host = await self._require(host.hostname)
        if host.status != "banned" and self.start_host is not None:
            await self.start_host(host)
        return host

    async def ban_domain(self, domain: str) -> list[str]:
        """Ban ``domain`` and block every known host under it; returns the hosts blocked."""
        domain = domain.strip().lower().strip(".")
        if not domain or " " in domain or "/" in domain:
            raise CrawlRefused("bad_domain", "not a domain")
        await self.store.add_domain_ban(domain)
        blocked: list[str] = []
        after: str | None = None
        while True:
            page = await self.store.list_hosts(after=after, limit=500)
            for host in page:
                if matches_domain(host.hostname, [domain]) and host.status != "banned":
                    await self.block(host.hostname)
                    blocked.append(host.hostname)
            if len(page) < 500:
                break
            after = page[-1].hostname
        await self.record_action("ban_domain", domain, blocked=blocked)
        return blocked

    async def unban_domain(self, domain: str) -> bool:
        removed = await self.store.remove_domain_ban(domain.strip().lower().strip("."))
        await self.record_action("unban_domain", domain)
        return removed

    async def set_crawling(self, enabled: bool) -> None:
        """Switch public crawling; stored, so it survives restarts (see :meth:`load_settings`)."""
        self.crawling_enabled = enabled
        self.crawling_source = "admin"
        await self.store.set_setting("crawling_enabled", "true" if enabled else "false")
        await self.record_action("set_crawling", "relay", enabled=enabled)

    async def refresh_status_gauge(self) -> None:
        """Set the host gauges from the board: no store read once the board is loaded (at
        start), so a scrape costs the same at 5,000 hosts as at 3."""
        await self.board.ensure_loaded()
        self.board.publish(self.metrics)
