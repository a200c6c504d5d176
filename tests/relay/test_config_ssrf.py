"""Configuration parsing and the SSRF guard."""

from __future__ import annotations

import argparse
import asyncio

import httpcore
import httpx
import pytest

from relay.config import SETTINGS, ConfigError, RelayConfig, add_arguments
from relay.ssrf import (
    AddressGuard,
    SafeClient,
    SSRFError,
    is_public_address,
    normalize_hostname,
    static_resolver,
)


def test_defaults_match_the_issue() -> None:
    c = RelayConfig.from_env({})
    assert c.bind == "127.0.0.1:2470" and (c.host, c.port) == ("127.0.0.1", 2470)
    assert c.plc_url == "https://plc.directory"
    assert c.replay_window == 72 * 3600
    assert c.admin_token == "" and c.allow_insecure_hosts is False
    assert not c.uses_postgres


def test_env_names_are_fixed_and_parsed() -> None:
    env = {
        "RELAY_DATABASE_URL": "postgresql://postgres@127.0.0.1/test",
        "RELAY_BIND": "0.0.0.0:9000",
        "RELAY_PLC_URL": "http://127.0.0.1:1",
        "RELAY_ADMIN_TOKEN": "s3cret",
        "RELAY_ALLOW_INSECURE_HOSTS": "true",
        "RELAY_REPLAY_WINDOW": "30m",
        "RELAY_TRUSTED_DOMAINS": "host.bsky.network, Example.COM.",
        "RELAY_DEFAULT_ACCOUNT_LIMIT": "7",
        "RELAY_REDIS_URL": "redis://127.0.0.1:6379/15",
    }
    c = RelayConfig.from_env(env)
    assert c.uses_postgres and c.port == 9000 and c.admin_token == "s3cret"
    assert c.allow_insecure_hosts is True and c.replay_window == 1800
    assert c.trusted_domains == ("host.bsky.network", "example.com")
    assert c.default_account_limit == 7 and c.redis_url.startswith("redis://")
    assert "s3cret" not in str(c.describe())


def test_flags_override_environment() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--bind", "127.0.0.1:0", "--replay-window", "3d"])
    c = RelayConfig.from_args(ns, {"RELAY_BIND": "127.0.0.1:5", "RELAY_ADMIN_TOKEN": "t"})
    assert c.port == 0 and c.replay_window == 3 * 86400 and c.admin_token == "t"
    assert {s.env for s in SETTINGS} >= {"RELAY_DATABASE_URL", "RELAY_BIND", "RELAY_PLC_URL"}


@pytest.mark.parametrize("env,reason", [
    ({"RELAY_BIND": "nope"}, "bad_bind"),
    ({"RELAY_ALLOW_INSECURE_HOSTS": "maybe"}, "bad_bool"),
    ({"RELAY_REPLAY_WINDOW": "forever"}, "bad_duration"),
    ({"RELAY_DEFAULT_ACCOUNT_LIMIT": "-1"}, "bad_int"),
])
def test_bad_settings_are_typed(env: dict[str, str], reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        RelayConfig.from_env(env)
    assert err.value.reason == reason


@pytest.mark.parametrize("raw,expected", [
    ("pds.example.com", "pds.example.com"),
    ("PDS.Example.com.", "pds.example.com"),
    ("https://pds.example.com/", "pds.example.com"),
    ("wss://pds.example.com", "pds.example.com"),
])
def test_hostnames_normalized(raw: str, expected: str) -> None:
    assert normalize_hostname(raw) == expected


@pytest.mark.parametrize("raw,reason", [
    ("localhost", "non_public_address"),
    ("10.0.0.1", "ip_literal"),
    ("169.254.169.254", "ip_literal"),
    ("pds.example.com:8080", "port_not_allowed"),
    ("http://pds.example.com", "insecure_scheme"),
    ("https://pds.example.com/path", "bad_hostname"),
    ("single", "bad_hostname"),
    ("bad_name.example.com", "bad_hostname"),
    ("", "bad_hostname"),
])
def test_hostnames_refused(raw: str, reason: str) -> None:
    with pytest.raises(SSRFError) as err:
        normalize_hostname(raw)
    assert err.value.reason == reason


def test_insecure_mode_allows_local_names() -> None:
    assert normalize_hostname("127.0.0.1:2583", allow_insecure=True) == "127.0.0.1:2583"
    assert normalize_hostname("localhost", allow_insecure=True) == "localhost"
    assert normalize_hostname("http://localhost:80", allow_insecure=True) == "localhost:80"


LONGEST = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters, the longest DNS name


@pytest.mark.parametrize("raw,insecure,expected", [
    ("example.com", False, "example.com"),  # two labels are enough
    ("pds.123.com", False, "pds.123.com"),  # only the last label may not be all digits
    ("  PDS.Example.COM.  ", False, "pds.example.com"),
    ("https://pds.example.com", False, "pds.example.com"),
    ("wss://pds.example.com/", False, "pds.example.com"),
    ("wss://" + LONGEST, False, LONGEST),  # 259 characters in all: the length limit is inclusive
    ("http://pds.example.com", True, "pds.example.com"),
    ("ws://pds.example.com:1", True, "pds.example.com:1"),
    ("pds.example.com:65535", True, "pds.example.com:65535"),
    ("[::1]:8080", True, "[::1]:8080"),
    ("https://[::1]:8080/", True, "[::1]:8080"),
    ("[::1]", True, "[::1]"),
    ("10.0.0.1", True, "10.0.0.1"),
    ("single", True, "single"),
    ("x.localhost", True, "x.localhost"),
])
def test_hostname_forms_accepted(raw: str, insecure: bool, expected: str) -> None:
    assert normalize_hostname(raw, allow_insecure=insecure) == expected


@pytest.mark.parametrize("raw,insecure,reason,message", [
    ("", False, "bad_hostname", "empty or overlong hostname"),
    (" \t ", False, "bad_hostname", "empty or overlong hostname"),
    ("wss://" + LONGEST[:-1] + "bb", False, "bad_hostname", "empty or overlong hostname"),  # 260
    ("http://pds.example.com", False, "insecure_scheme", "scheme http not allowed"),
    ("ws://pds.example.com", False, "insecure_scheme", "scheme ws not allowed"),
    ("ftp://pds.example.com", True, "bad_hostname", "unsupported scheme 'ftp'"),
    ("https://pds.example.com/x", False, "bad_hostname", "hostname must not carry a path, query or credentials"),
    ("https://pds.example.com?a=1", False, "bad_hostname", "hostname must not carry a path, query or credentials"),
    ("https://pds.example.com#top", False, "bad_hostname", "hostname must not carry a path, query or credentials"),
    ("https://me@pds.example.com", False, "bad_hostname", "hostname must not carry a path, query or credentials"),
    ("pds.example.com/x", False, "bad_hostname", "hostname must not contain a path or credentials"),
    ("me@pds.example.com", True, "bad_hostname", "hostname must not contain a path or credentials"),
    ("pds.exa mple.com", True, "bad_hostname", "hostname must not contain a path or credentials"),
    ("[::1", True, "bad_hostname", "unterminated IPv6 literal"),
    ("[::1]x", True, "bad_hostname", "junk after IPv6 literal"),
    ("[::1]]", True, "bad_hostname", "junk after IPv6 literal"),  # the literal ends at the first "]"
    ("::1", True, "bad_hostname", "IPv6 literals must be bracketed"),
    ("pds.example.com:8080", False, "port_not_allowed", "hostnames with a port need RELAY_ALLOW_INSECURE_HOSTS"),
    ("[::1]:8080", False, "port_not_allowed", "hostnames with a port need RELAY_ALLOW_INSECURE_HOSTS"),
    ("pds.example.com:0", True, "bad_hostname", "bad port '0'"),
    ("pds.example.com:65536", True, "bad_hostname", "bad port '65536'"),
    ("pds.example.com:x1", True, "bad_hostname", "bad port 'x1'"),
    ("pds.example.com:", True, "bad_hostname", "bad port ''"),
    ("10.0.0.1", False, "ip_literal", "IP addresses are not hostnames"),
    ("[2606:4700::1111]", False, "ip_literal", "IP addresses are not hostnames"),
    ("localhost.", False, "non_public_address", "localhost is a loopback name"),
    ("pds.localhost", False, "non_public_address", "pds.localhost is a loopback name"),
    ("bad_name.example.com", True, "bad_hostname", "invalid hostname syntax 'bad_name.example.com'"),
    ("-pds.example.com", True, "bad_hostname", "invalid hostname syntax '-pds.example.com'"),
    ("single", False, "bad_hostname", "'single' is not a fully qualified public name"),
    ("example.123", False, "bad_hostname", "'example.123' is not a fully qualified public name"),
])
def test_hostname_refusals_say_why(raw: str, insecure: bool, reason: str, message: str) -> None:
    """The reason (a metric label) and the message, which ``requestCrawl`` returns to the caller."""
    with pytest.raises(SSRFError) as err:
        normalize_hostname(raw, allow_insecure=insecure)
    assert (err.value.reason, str(err.value)) == (reason, message)


async def test_check_host_every_address_must_be_public() -> None:
    """``check_host``: the name is trimmed (brackets, a final dot) and lower-cased before it is
    resolved; IP literals are checked as they are; loopback names are refused without a lookup
    (insecure: 127.0.0.1); a name without addresses is a DNS failure; one non-public address
    among several refuses the name, and the message names it. Insecure mode checks nothing."""
    table = {"good.example.com": ["8.8.8.8", "2606:4700::1111"], "mixed.example.com": ["8.8.8.8", "10.0.0.1"],
             "empty.example.com": [], "x.example.cox": ["8.8.4.4"]}
    lookups: list[str] = []
    inner = static_resolver(table)

    async def resolver(host: str) -> list[str]:
        lookups.append(host)
        return await inner(host)

    guard = AddressGuard(resolver=resolver)
    assert await guard.check_host("[Good.Example.COM.]") == ["8.8.8.8", "2606:4700::1111"]
    assert await guard.check_host("8.8.8.8") == ["8.8.8.8"]
    assert await guard.check_host("[2606:4700::1111]") == ["2606:4700::1111"]
    assert lookups == ["good.example.com"]
    refused = {
        "mixed.example.com": ("non_public_address", "mixed.example.com resolves to non-public 10.0.0.1"),
        "[::1]": ("non_public_address", "::1 resolves to non-public ::1"),
        "LocalHost.": ("non_public_address", "localhost is a loopback name"),
        "a.localhost": ("non_public_address", "a.localhost is a loopback name"),
        "empty.example.com": ("dns_failure", "empty.example.com has no addresses"),
    }
    for host, (reason, message) in refused.items():
        with pytest.raises(SSRFError) as err:
            await guard.check_host(host)
        assert (err.value.reason, str(err.value)) == (reason, message), host
    assert lookups == ["good.example.com", "mixed.example.com", "empty.example.com"]
    insecure = AddressGuard(allow_insecure=True, resolver=inner)
    assert await insecure.check_host("mixed.example.com") == ["8.8.8.8", "10.0.0.1"]
    assert await insecure.check_host("a.localhost") == ["127.0.0.1"]
    assert await insecure.check_host("[::1]") == ["::1"]
    # only brackets and final dots are trimmed (a name may begin or end with any letter), then lower-cased
    assert await guard.check_host("[X.Example.COX.]") == ["8.8.4.4"]


@pytest.mark.parametrize("addr,public", [
    ("8.8.8.8", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::ffff:127.0.0.1", False),
    ("2606:4700::1111%eth0", True), ("fe80::1%eth0", False), ("not-an-address", False), ("", False),
    ("8.8.8.8.8", False),
])
def test_public_address_classification(addr: str, public: bool) -> None:
    assert is_public_address(addr) is public


async def test_guard_refuses_names_resolving_to_loopback() -> None:
    guard = AddressGuard(resolver=static_resolver({"evil.example.com": ["127.0.0.1"],
                                                   "mixed.example.com": ["8.8.8.8", "10.0.0.1"],
                                                   "good.example.com": ["8.8.8.8"]}))
    for host in ("evil.example.com", "mixed.example.com", "10.0.0.1", "169.254.169.254", "localhost"):
        with pytest.raises(SSRFError) as err:
            await guard.check_host(host)
        assert err.value.reason == "non_public_address"
    assert await guard.check_host("good.example.com") == ["8.8.8.8"]
    insecure = AddressGuard(allow_insecure=True, resolver=static_resolver({"evil.example.com": ["127.0.0.1"]}))
    assert await insecure.check_host("evil.example.com") == ["127.0.0.1"]


async def test_redirect_to_private_address_is_refused() -> None:
    """The public hop (a stand-in for the internet) redirects to 169.254.169.254: refused."""
    hops: list[str] = []

    def internet(request: httpx.Request) -> httpx.Response:
        hops.append(str(request.url))
        return httpx.Response(302, headers={"location": "https://169.254.169.254/latest/meta-data"})

    guard = AddressGuard(resolver=static_resolver({"pds.example.com": ["8.8.8.8"]}))
    client = SafeClient(guard, inner_transport=httpx.MockTransport(internet))
    try:
        with pytest.raises(SSRFError) as err:
            await client.get("https://pds.example.com/xrpc/com.atproto.sync.getRepo")
        assert err.value.reason == "non_public_address"
        assert hops == ["https://pds.example.com/xrpc/com.atproto.sync.getRepo"]
        with pytest.raises(SSRFError) as err:
            await client.get("http://pds.example.com/")
        assert err.value.reason == "insecure_scheme"
    finally:
        await client.aclose()


async def test_body_size_limit() -> None:
    def internet(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"x" * 5000)

    guard = AddressGuard(resolver=static_resolver({"pds.example.com": ["8.8.8.8"]}))
    client = SafeClient(guard, inner_transport=httpx.MockTransport(internet))
    try:
        status, body, _ = await client.get("https://pds.example.com/a", max_bytes=5000)
        assert status == 200 and len(body) == 5000
        with pytest.raises(SSRFError) as err:
            await client.get("https://pds.example.com/a", max_bytes=4999)
        assert err.value.reason == "too_large"
    finally:
        await client.aclose()


def test_readme_configuration_table_matches_settings() -> None:
    """The README's configuration table is the one ``settings_table()`` writes (kept true)."""
    from pathlib import Path

    from relay.config import settings_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert settings_table() in readme


class _RecordingNetwork(httpcore.AsyncNetworkBackend):
    """Stands in for the public internet below the pinned transport: records where each socket
    would go and refuses it (no public address is reachable from the test machine)."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connects.append((host, port))
        raise httpcore.ConnectError("no internet here")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise AssertionError("unix socket")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def test_connection_goes_to_the_address_vetted_at_connect_time() -> None:
    """DNS rebinding: the name answers a public address once, then loopback. One lookup per
    connection, and the socket goes to the address that lookup vetted — never to the name."""
    answers = [["93.184.216.34"], ["127.0.0.1"]]
    lookups: list[str] = []

    async def rebinding(host: str) -> list[str]:
        lookups.append(host)
        return answers[min(len(lookups) - 1, 1)]

    net = _RecordingNetwork()
    client = SafeClient(AddressGuard(resolver=rebinding), network_backend=net)
    try:
        with pytest.raises(httpx.ConnectError):
            await client.get("https://pds.example.com/xrpc/_health")
        assert lookups == ["pds.example.com"]
        assert net.connects == [("93.184.216.34", 443)]
        with pytest.raises(SSRFError) as err:  # the next connection's lookup says loopback
            await client.get("https://pds.example.com/xrpc/_health")
        assert err.value.reason == "non_public_address"
        assert net.connects == [("93.184.216.34", 443)]  # nothing was opened for it
    finally:
        await client.aclose()


async def test_safe_client_connects_to_the_resolved_address_not_the_name() -> None:
    """A real server on 127.0.0.1 answers for a name the system cannot resolve (.invalid): the
    request only succeeds because the socket goes to the guard's address; Host stays the name."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    guard = AddressGuard(allow_insecure=True, resolver=static_resolver({"pds.invalid": ["127.0.0.1"]}))
    client = SafeClient(guard)
    try:
        status, body, _ = await client.get(f"http://pds.invalid:{port}/xrpc/_health")
        assert (status, body) == (200, b"ok")
        assert f"host: pds.invalid:{port}".encode() in seen[0].lower()
        assert await guard.connect_address("pds.invalid") == "127.0.0.1"
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
