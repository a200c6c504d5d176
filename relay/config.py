"""Relay configuration: environment variables with matching command-line flags.

Every setting has one environment variable (``RELAY_*``) and one flag (``--bind`` …); a flag
given on the command line wins over the environment, which wins over the default. The names of
the environment variables are fixed (operators and external test harnesses use them).

``RelayConfig.from_env(env)`` reads only the environment; ``add_arguments(parser)`` plus
``RelayConfig.from_args(ns, env)`` give the CLI its flags. ``SETTINGS`` is the single table the
README's configuration section is written from.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from mst.errors import ReasonError


def parse_nameservers(text: str) -> list[tuple[str, int]]:
    """``"10.0.0.2, 127.0.0.1:5353, [::1]:53"`` → ``[(address, port), …]``; ValueError if malformed."""
    servers = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.startswith("["):
            address, bracket, rest = item[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"bad bracketed address {item!r}")
            port = int(rest[1:]) if rest.startswith(":") else 53
        elif item.count(":") == 1:
            address, port_text = item.split(":")
            port = int(port_text)
        else:
            address, port = item, 53
        ipaddress.ip_address(address)
        if not 0 < port < 65536:
            raise ValueError(f"bad DNS server port in {item!r}")
        servers.append((address, port))
    return servers


class ConfigError(ReasonError, ValueError):
    """A setting could not be parsed; ``reason`` is snake_case, the message names the variable
    (and is all of ``str(exc)``)."""

    show_reason = False


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration knob: field name, environment variable, flag, default, help."""

    name: str
    env: str
    flag: str
    default: str
    help: str
    kind: str = "str"  # str | bool | int | duration | list


SETTINGS: tuple[Setting, ...] = (
    Setting("database_url", "RELAY_DATABASE_URL", "--database-url", "data/relay.sqlite",
            "SQLite file path, or postgresql://user@host/db"),
    Setting("bind", "RELAY_BIND", "--bind", "127.0.0.1:2470", "address:port to listen on"),
    Setting("firehose_bind", "RELAY_FIREHOSE_BIND", "--firehose-bind", "",
            "optional second address:port serving only subscribeRepos from a plain websockets "
            "server (each extra consumer costs ~0.2-0.6 us of relay CPU per frame there, ~2.5 us on the "
            "main port; for fan-out-heavy setups)"),
    Setting("ws_deflate", "RELAY_WS_DEFLATE", "--ws-deflate", "false",
            "offer permessage-deflate on the WebSocket streams (subscribeRepos on both ports, /subscribe): "
            "consumers that ask for it get compressed frames, at the cost of relay CPU per consumer",
            "bool"),
    Setting("plc_url", "RELAY_PLC_URL", "--plc-url", "https://plc.directory", "PLC directory for did:plc"),
    Setting("admin_token", "RELAY_ADMIN_TOKEN", "--admin-token", "",
            "Bearer token for /admin/ (admin API is off when empty)"),
    Setting("console_ingest_url", "RELAY_CONSOLE_INGEST_URL", "--console-ingest-url", "",
            "fan-out: base URL of the ingest's HTTP port (e.g. http://relay-ingest:2470); the operator "
            "console's actions and admin views on a fan-out are forwarded there with the operator's token "
            "(empty: read-only console on fan-outs)"),
    Setting("allow_insecure_hosts", "RELAY_ALLOW_INSECURE_HOSTS", "--allow-insecure-hosts", "false",
            "allow ws:// / http:// upstreams, host:port names and loopback/private addresses; "
            "loopback hosts are then not rate-limited (local testing only)",
            "bool"),
    Setting("replay_window", "RELAY_REPLAY_WINDOW", "--replay-window", "72h",
            "how long events are kept for cursor replay (e.g. 72h, 30m, 3d)", "duration"),
    Setting("trusted_domains", "RELAY_TRUSTED_DOMAINS", "--trusted-domains", "",
            "comma-separated domains whose hosts have no account limit (suffix match)", "list"),
    Setting("default_account_limit", "RELAY_DEFAULT_ACCOUNT_LIMIT", "--default-account-limit", "100",
            "accounts allowed per untrusted host; more are held as throttled", "int"),
    Setting("redis_url", "RELAY_REDIS_URL", "--redis-url", "",
            "redis://… for scale-out (Redis Streams bus, shared identity cache)"),
    Setting("bus_max_entries", "RELAY_BUS_MAX_ENTRIES", "--bus-max-entries", "200000",
            "scale-out: length cap of the Redis stream (approximate trim). An entry is one event frame plus "
            "~100 bytes of Redis overhead, ~2.3 KB with typical traffic: the default needs ~450 MB of Redis "
            "memory. Fan-outs read anything trimmed (or lost) from the database, so a smaller cap costs "
            "latency, never events", "int"),
    Setting("redis_stream", "RELAY_REDIS_STREAM", "--redis-stream", "relay:events",
            "Redis Streams key of the event bus (ingest and fan-out must agree)"),
    Setting("redis_timeout", "RELAY_REDIS_TIMEOUT", "--redis-timeout", "2s",
            "scale-out: longest wait for one Redis reply (every client: bus, identity cache, readiness); "
            "a hung Redis raises after this, once (no hidden retries)", "duration"),
    Setting("redis_connect_timeout", "RELAY_REDIS_CONNECT_TIMEOUT", "--redis-connect-timeout", "2s",
            "scale-out: longest wait for a new Redis connection", "duration"),
    Setting("redis_health_check", "RELAY_REDIS_HEALTH_CHECK", "--redis-health-check", "30s",
            "scale-out: a Redis connection idle this long is PINGed before it is used again", "duration"),
    Setting("bus_publish_max_bytes", "RELAY_BUS_PUBLISH_MAX_BYTES", "--bus-publish-max-bytes", "67108864",
            "committed events waiting for the bus, in bytes (frames + ~200 per event): sequencing never waits "
            "for the bus; past this the oldest are not published (fan-outs read them from the database)", "int"),
    Setting("bus_publish_timeout", "RELAY_BUS_PUBLISH_TIMEOUT", "--bus-publish-timeout", "5s",
            "longest wait for one publish to the bus; a failed publish is retried with backoff", "duration"),
    Setting("new_hosts_per_day", "RELAY_NEW_HOSTS_PER_DAY", "--new-hosts-per-day", "50",
            "limit on hosts added through public requestCrawl in any 24 h (counted in the database)", "int"),
    Setting("crawling_enabled", "RELAY_CRAWLING", "--crawling", "true",
            "accept public requestCrawl; an admin API toggle is stored and outlives restarts until this value changes",
            "bool"),
    Setting("validation_workers", "RELAY_VALIDATION_WORKERS", "--validation-workers", "2",
            "processes verifying commits in parallel (0 = in the event loop)", "int"),
    Setting("resync_workers", "RELAY_RESYNC_WORKERS", "--resync-workers", "4",
            "parallel repository resyncs", "int"),
    Setting("resync_retry_base", "RELAY_RESYNC_RETRY_BASE", "--resync-retry-base", "2s",
            "a failed resync is retried after this delay, doubled after each further failure (each delay "
            "jittered within its upper half); retries never stop, and start at once when the account's host "
            "sends something new for it", "duration"),
    Setting("resync_retry_max", "RELAY_RESYNC_RETRY_MAX", "--resync-retry-max", "30s",
            "the longest delay between two resync attempts of one account: a repository the host serves "
            "again is fetched within this, even when the account sends nothing", "duration"),
    Setting("resync_held_bytes_per_account", "RELAY_RESYNC_HELD_BYTES_PER_ACCOUNT",
            "--resync-held-bytes-per-account", "4194304",
            "frames of an account being resynchronised are held (then judged after its #sync) up to this "
            "many bytes; past it the oldest are dropped (resync_buffer_full): the #sync covers them", "int"),
    Setting("resync_held_bytes_total", "RELAY_RESYNC_HELD_BYTES_TOTAL", "--resync-held-bytes-total", "268435456",
            "bytes of held frames over all accounts being resynchronised (same rule)", "int"),
    Setting("repair_interval", "RELAY_REPAIR_INTERVAL", "--repair-interval", "5s",
            "how often Spark repairs queued in the outbox are applied", "duration"),
    Setting("repair_settle", "RELAY_REPAIR_SETTLE", "--repair-settle", "10s",
            "a Spark repair waits until the relay has read its host's stream this far past the moment "
            "the job looked (or the host has been quiet this long): the host's clock-skew margin", "duration"),
    Setting("identity_rate", "RELAY_IDENTITY_RATE", "--identity-rate", "200",
            "DID resolutions per second (PLC / did:web), bursts up to 2.5x; half as many in flight at once "
            "(64 to 256)", "int"),
    Setting("identity_max_age", "RELAY_IDENTITY_MAX_AGE", "--identity-max-age", "24h",
            "identities are kept in the database (a restart resolves nothing known again); one fetched "
            "longer ago than this is resolved again on its next use, and kept in use while the directory "
            "is unreachable (0 = never by age; #identity and signature failures always re-resolve)", "duration"),
    Setting("handle_resolver_url", "RELAY_HANDLE_RESOLVER_URL", "--handle-resolver-url", "",
            "resolve handles via this service's com.atproto.identity.resolveHandle instead of "
            "DNS TXT _atproto.HANDLE, then https://HANDLE/.well-known/atproto-did"),
    Setting("dns_servers", "RELAY_DNS_SERVERS", "--dns-servers", "",
            "DNS servers (ip or ip:port, comma-separated) for handle TXT lookups; empty = /etc/resolv.conf"),
    Setting("identity_retry", "RELAY_IDENTITY_RETRY", "--identity-retry", "1m",
            "how long a frame whose DID could not be resolved for a transient reason (directory or DNS "
            "unreachable, timed out, rate limited) is tried again (1 s doubling to 30 s, holding only its own "
            "account); past it the frame is rejected, and a known account's commit is covered by a resync",
            "duration"),
    Setting("handle_wait", "RELAY_HANDLE_WAIT", "--handle-wait", "1s",
            "how long an #identity waits for its handle's check before it is passed on with the handle "
            "stripped (only its own account waits; the handle follows in a second #identity once it "
            "verifies)", "duration"),
    Setting("handle_timeout", "RELAY_HANDLE_TIMEOUT", "--handle-timeout", "10s",
            "a handle check (DNS, then HTTPS) that takes longer fails; failures are remembered for 60 s",
            "duration"),
    Setting("host_clock_skew", "RELAY_HOST_CLOCK_SKEW", "--host-clock-skew", "5m",
            "how far a host's clock may be ahead of the relay's: a first-seen account whose commit chains on "
            "one made (by its TID) more than this after the relay began following the host is resynchronised "
            "(the relay missed that commit, e.g. the host was wiped while the relay was away)", "duration"),
    Setting("ingest_buffer_mb", "RELAY_INGEST_BUFFER_MB", "--ingest-buffer-mb", "128",
            "memory for upstream frames read and not yet stored, across all hosts (MB, counted as twice a "
            "frame's size plus 2 KiB; one host may use an eighth of it, and at most 512 frames); a host "
            "over its share stops being read until its frames are stored", "int"),
    Setting("lenient_sync_validation", "RELAY_LENIENT_SYNC_VALIDATION", "--lenient-sync-validation", "false",
            "accept sync 1.0 commits (no prevData, or update/delete ops without prev) after every check but "
            "operation inversion, counted as lenient_no_prev_data / lenient_no_op_prev; per host: admin "
            "validation endpoint", "bool"),
    Setting("getrepo_proxy", "RELAY_GETREPO_PROXY", "--getrepo-proxy", "false",
            "serve getRepo from the relay (concurrent requests share one fetch from the PDS, the CAR is "
            "verified before it is served, small cache) instead of a 302 to the PDS", "bool"),
    Setting("getrepo_cache_mb", "RELAY_GETREPO_CACHE_MB", "--getrepo-cache-mb", "64",
            "getRepo proxy: memory for cached verified CARs (MB; a CAR over a quarter of it is not cached, "
            "one over the whole is answered with the 302)", "int"),
    Setting("consumer_max_lag", "RELAY_CONSUMER_MAX_LAG", "--consumer-max-lag", "15s",
            "a live subscribeRepos consumer whose connection has not taken an event this long after it was "
            "sent (checked with WebSocket pings) gets ConsumerTooSlow and is disconnected", "duration"),
    Setting("consumer_max_queue_bytes", "RELAY_CONSUMER_MAX_QUEUE_BYTES", "--consumer-max-queue-bytes",
            "67108864", "bytes of live events waiting for one consumer — unsent in its connection's write buffer, "
            "or queued (at most 10,000 events) while it is not yet written to directly — before it gets "
            "ConsumerTooSlow", "int"),
    Setting("replay_buffer_mb", "RELAY_REPLAY_BUFFER_MB", "--replay-buffer-mb", "128",
            "memory for events read from the store for replaying consumers, all of them together (MB); each "
            "read asks for an equal share (at most 4 MiB), so more replaying consumers each wait longer, never "
            "use more memory; one whose connection takes no batch within RELAY_CONSUMER_MAX_LAG while others "
            "wait gets ConsumerTooSlow", "int"),
    Setting("http_header_timeout", "RELAY_HTTP_HEADER_TIMEOUT", "--http-header-timeout", "10s",
            "main port: a connection whose request headers (a WebSocket upgrade request included) have not all "
            "arrived this long after it opened, or after its previous response, is answered 408 and closed "
            "(0 = no limit)", "duration"),
    Setting("max_connections", "RELAY_MAX_CONNECTIONS", "--max-connections", "10000",
            "main port: open connections (HTTP and WebSocket); past it a new connection is answered 503 with "
            "Retry-After and closed (0 = no limit; each one is a file descriptor)", "int"),
    Setting("max_websockets", "RELAY_MAX_WEBSOCKETS", "--max-websockets", "5000",
            "main port: open WebSockets (subscribeRepos, /subscribe); past it an upgrade is answered 503 with "
            "Retry-After (0 = no limit)", "int"),
    Setting("crawl_requests_per_minute", "RELAY_CRAWL_REQUESTS_PER_MINUTE", "--crawl-requests-per-minute", "10",
            "requestCrawl calls one client address may make per minute (bursts up to the same number); more are "
            "answered 429 with Retry-After (0 = no limit)", "int"),
    Setting("admin_auth_failures_per_minute", "RELAY_ADMIN_AUTH_FAILURES_PER_MINUTE",
            "--admin-auth-failures-per-minute", "10",
            "admin requests with a missing or wrong token one client address may make per minute; past it every "
            "admin request from that address is answered 429 with Retry-After until it may try again "
            "(0 = no limit)", "int"),
    Setting("sibling_relays", "RELAY_SIBLING_RELAYS", "--sibling-relays", "",
            "comma-separated base URLs (http(s)://host[:port]) of sibling relays: a requestCrawl and the admin "
            "changes that succeed here (limits, block/unblock, domain bans, takedowns) are passed on to each, with "
            "the same Authorization and Via: 1.1 atproto-relay (a change that arrives with it is not passed on "
            "again); failures are retried with backoff, never delay the change here", "list"),
    Setting("log_level", "RELAY_LOG_LEVEL", "--log-level", "info", "debug, info, warning or error"),
    Setting("status_heal_interval", "RELAY_STATUS_HEAL_INTERVAL", "--status-heal-interval", "24h",
            "account-status self-healing: every host's listRepos is read fully once per interval and each account's "
            "status compared with the relay's; a divergence is repaired with an #account (0 = off)", "duration"),
    Setting("status_heal_suspect_delay", "RELAY_STATUS_HEAL_SUSPECT_DELAY", "--status-heal-suspect-delay", "5m",
            "an account that looks inconsistent (a commit while held inactive) is checked with getRepoStatus this "
            "soon, at most once per this delay; a host whose stream reconnected is listed again soon, at most once "
            "per the larger of this delay and a 24th of RELAY_STATUS_HEAL_INTERVAL",
            "duration"),
    Setting("status_heal_timeout", "RELAY_STATUS_HEAL_TIMEOUT", "--status-heal-timeout", "10s",
            "each listRepos / getRepoStatus request of the self-healing; a host that does not answer is retried "
            "later (never read as having deleted its accounts)", "duration"),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError("bad_bool", f"{name}: expected true/false, got {raw!r}")


def parse_duration(name: str, raw: str) -> float:
    """``72h`` → 259200.0 seconds; a bare number is seconds."""
    m = _DURATION.match(raw)
    if not m:
        raise ConfigError("bad_duration", f"{name}: expected a duration like 72h, 30m, 3d; got {raw!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError("bad_int", f"{name}: expected an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError("bad_int", f"{name}: must not be negative")
    return value


def parse_bind(raw: str, name: str = "RELAY_BIND") -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not host:
        raise ConfigError("bad_bind", f"{name}: expected address:port, got {raw!r}")
    try:
        port_num = int(port)
    except ValueError:
        raise ConfigError("bad_bind", f"{name}: bad port in {raw!r}") from None
    if not 0 <= port_num < 65536:
        raise ConfigError("bad_bind", f"{name}: port out of range in {raw!r}")
    return host.strip("[]"), port_num


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """The relay's settings, parsed. See ``SETTINGS`` for the environment names."""

    database_url: str = "data/relay.sqlite"
    bind: str = "127.0.0.1:2470"
    firehose_bind: str = ""
    ws_deflate: bool = False
    plc_url: str = "https://plc.directory"
    admin_token: str = ""
    console_ingest_url: str = ""
    allow_insecure_hosts: bool = False
    replay_window: float = 72 * 3600.0
    trusted_domains: tuple[str, ...] = field(default_factory=tuple)
    default_account_limit: int = 100
    redis_url: str = ""
    bus_max_entries: int = 200_000
    redis_stream: str = "relay:events"
    redis_timeout: float = 2.0
    redis_connect_timeout: float = 2.0
    redis_health_check: float = 30.0
    bus_publish_max_bytes: int = 64 * 1024 * 1024
    bus_publish_timeout: float = 5.0
    new_hosts_per_day: int = 50
    crawling_enabled: bool = True
    validation_workers: int = 2
    resync_workers: int = 4
    resync_retry_base: float = 2.0
    resync_retry_max: float = 30.0
    resync_held_bytes_per_account: int = 4 * 1024 * 1024
    resync_held_bytes_total: int = 256 * 1024 * 1024
    repair_interval: float = 5.0
    repair_settle: float = 10.0
    identity_rate: int = 200
    identity_max_age: float = 24 * 3600.0
    handle_resolver_url: str = ""
    dns_servers: str = ""
    identity_retry: float = 60.0
    handle_wait: float = 1.0
    handle_timeout: float = 10.0
    host_clock_skew: float = 300.0
    ingest_buffer_mb: int = 128
    lenient_sync_validation: bool = False
    getrepo_proxy: bool = False
    getrepo_cache_mb: int = 64
    consumer_max_lag: float = 15.0
    consumer_max_queue_bytes: int = 64 * 1024 * 1024
    replay_buffer_mb: int = 128
    http_header_timeout: float = 10.0
    max_connections: int = 10_000
    max_websockets: int = 5000
    crawl_requests_per_minute: int = 10
    admin_auth_failures_per_minute: int = 10
    sibling_relays: tuple[str, ...] = field(default_factory=tuple)
    log_level: str = "info"
    status_heal_interval: float = 24 * 3600.0
    status_heal_suspect_delay: float = 300.0
    status_heal_timeout: float = 10.0

    @property
    def host(self) -> str:
        return parse_bind(self.bind)[0]

    @property
    def port(self) -> int:
        return parse_bind(self.bind)[1]

    @property
    def uses_postgres(self) -> bool:
        return self.database_url.startswith(("postgresql://", "postgres://"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RelayConfig:
        """Parse every ``RELAY_*`` variable present in ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        return cls.from_values({s.name: env[s.env] for s in SETTINGS if s.env in env})

    @classmethod
    def from_values(cls, raw: Mapping[str, str]) -> RelayConfig:
        """Build from raw strings keyed by field name; missing keys take the defaults."""
        values: dict[str, object] = {}
        for s in SETTINGS:
            text = raw.get(s.name, s.default)
            if text is None:
                text = s.default
            values[s.name] = _convert(s, str(text))
        config = cls(**values)  # type: ignore[arg-type]
        parse_bind(config.bind)
        if config.firehose_bind:
            parse_bind(config.firehose_bind, "RELAY_FIREHOSE_BIND")
        try:
            parse_nameservers(config.dns_servers)
        except ValueError:
            raise ConfigError("bad_dns_servers", f"RELAY_DNS_SERVERS: expected ip[:port],…; got {config.dns_servers!r}") from None
        if not config.redis_stream:
            raise ConfigError("bad_redis_stream", "RELAY_REDIS_STREAM must not be empty")
        if config.console_ingest_url and not re.match(r"^https?://[^/]", config.console_ingest_url):
            raise ConfigError("bad_console_ingest_url",
                              f"RELAY_CONSOLE_INGEST_URL: expected http(s)://host…, got {config.console_ingest_url!r}")
        if not re.match(r"^https?://[^/]", config.plc_url):
            raise ConfigError("bad_plc_url", f"RELAY_PLC_URL: expected http(s)://host…, got {config.plc_url!r}")
        for name, env in (("redis_timeout", "RELAY_REDIS_TIMEOUT"), ("redis_connect_timeout", "RELAY_REDIS_CONNECT_TIMEOUT"),
                          ("redis_health_check", "RELAY_REDIS_HEALTH_CHECK"), ("bus_publish_timeout", "RELAY_BUS_PUBLISH_TIMEOUT")):
            if getattr(config, name) <= 0:
                raise ConfigError("bad_duration", f"{env}: must be more than 0")
        if config.bus_publish_max_bytes < 1024 * 1024:
            raise ConfigError("bad_int", "RELAY_BUS_PUBLISH_MAX_BYTES: must be at least 1048576")
        if config.consumer_max_lag <= 0:
            raise ConfigError("bad_duration", "RELAY_CONSUMER_MAX_LAG: must be more than 0")
        if config.consumer_max_queue_bytes < 1024 * 1024:
            raise ConfigError("bad_int", "RELAY_CONSUMER_MAX_QUEUE_BYTES: must be at least 1048576")
        if config.replay_buffer_mb < 1:
            raise ConfigError("bad_int", "RELAY_REPLAY_BUFFER_MB: must be at least 1")
        if config.resync_retry_base <= 0 or config.resync_retry_max < config.resync_retry_base:
            raise ConfigError("bad_duration", "RELAY_RESYNC_RETRY_BASE must be more than 0 and at most "
                              "RELAY_RESYNC_RETRY_MAX")
        for url in config.sibling_relays:
            if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", url):
                raise ConfigError("bad_sibling_relays", f"RELAY_SIBLING_RELAYS: expected http(s)://host[:port],…; "
                                                        f"got {url!r}")
        if config.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("bad_log_level", f"RELAY_LOG_LEVEL: unknown level {config.log_level!r}")
        return config

    @classmethod
    def from_args(cls, ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> RelayConfig:
        """Flags (when given) override the environment, which overrides the defaults."""
        env = os.environ if env is None else env
        raw = {s.name: env[s.env] for s in SETTINGS if s.env in env}
        for s in SETTINGS:
            value = getattr(ns, s.name, None)
            if value is not None:
                raw[s.name] = value
        return cls.from_values(raw)

    def with_(self, **changes: object) -> RelayConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> dict[str, object]:
        """Settings for logging at start (the admin token is masked)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["admin_token"]:
            out["admin_token"] = "***"
        return out


def _convert(s: Setting, text: str) -> object:
    if s.kind == "bool":
        return parse_bool(s.env, text)
    if s.kind == "int":
        return parse_int(s.env, text)
    if s.kind == "duration":
        return parse_duration(s.env, text)
    if s.kind == "list":
        return tuple(p.strip().lower().strip(".") for p in text.split(",") if p.strip())
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting (all default to None so the environment can fill in)."""
    for s in SETTINGS:
        parser.add_argument(s.flag, dest=s.name, default=None, metavar=s.env,
                            help=f"{s.help} [env {s.env}, default {s.default or 'empty'}]")


def settings_table() -> str:
    """The Markdown configuration table (the README's copy is generated from this)."""
    rows = ["| Variable | Flag | Default | Meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "(empty)"
        rows.append(f"| `{s.env}` | `{s.flag}` | {default} | {s.help} |")
    return "\n".join(rows)
