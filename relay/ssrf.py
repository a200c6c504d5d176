"""Outbound-request safety: hostname syntax, address checks and an SSRF-checked HTTP client.

Every request to a host derived from untrusted input (``requestCrawl`` hostnames, PDS endpoints
from DID documents, did:web domains, handles) goes through ``SafeClient``: the scheme must be
https/wss, the name must resolve only to public addresses, and the check is repeated for every
redirect hop (httpx calls the transport once per hop). With ``allow_insecure`` (local testing)
http/ws, ``host:port`` names and loopback/private addresses are accepted.

DNS rebinding is closed by resolving once: ``SafeClient`` opens each TCP connection to an address
the guard has just vetted (``_GuardedBackend``), never re-resolving the name (TLS still verifies
the certificate for the name), and upstream WebSocket subscriptions connect to
``AddressGuard.connect_address(host)`` the same way. A name that answers a public address to the
check and a private one to the connection therefore cannot reach the private one.

Rejections raise ``SSRFError`` with a snake_case ``reason`` from ``REASONS``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from urllib.parse import urlsplit

import httpcore
import httpx

from mst.errors import ReasonError

REASONS = (
    "bad_hostname",
    "bad_url",
    "insecure_scheme",
    "port_not_allowed",
    "ip_literal",
    "non_public_address",
    "dns_failure",
    "too_large",
)

_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_BLOCKED_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}

Resolver = Callable[[str], Awaitable[list[str]]]


class SSRFError(ReasonError):
    """An outbound request was refused. ``reason`` is one of ``REASONS``; ``str(exc)`` is the
    message alone."""

    show_reason = False


async def system_resolver(host: str) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), via the system resolver."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise SSRFError("dns_failure", f"cannot resolve {host}: {exc}") from None
    return sorted({str(info[4][0]) for info in infos})  # str() for the type: IP sockaddrs hold str


def static_resolver(table: Mapping[str, list[str]], fallback: Resolver | None = None) -> Resolver:
    """A resolver answering from ``table`` first (tests stand in for public DNS with this)."""

    async def resolve(host: str) -> list[str]:
        if host in table:
            return list(table[host])
        if fallback is None:
            raise SSRFError("dns_failure", f"cannot resolve {host}")
        return await fallback(host)

    return resolve


def is_public_address(addr: str) -> bool:
    """True only for globally routable unicast addresses (IPv4-mapped IPv6 is unwrapped)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return bool(
        ip.is_global
        and not ip.is_multicast
        and not ip.is_loopback
        and not ip.is_link_local
        and not ip.is_private
        and not ip.is_reserved
        and not ip.is_unspecified
    )


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def normalize_hostname(raw: str, *, allow_insecure: bool = False) -> str:
    """Turn a requestCrawl ``hostname`` into the canonical lower-case form, or raise.

    Accepts a bare name, optionally with an ``https://``/``wss://`` prefix (``http``/``ws`` only
    when insecure) and no path. Secure mode requires a public DNS name of at least two labels
    with no port and no IP literal; insecure mode also allows ``host:port``, IPs and localhost.
    """
    text = (raw or "").strip().lower()
    if not text or len(text) > 253 + 6:
        raise SSRFError("bad_hostname", "empty or overlong hostname")
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme in ("http", "ws") and not allow_insecure:
            raise SSRFError("insecure_scheme", f"scheme {parts.scheme} not allowed")
        if parts.scheme not in ("https", "wss", "http", "ws"):
            raise SSRFError("bad_hostname", f"unsupported scheme {parts.scheme!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise SSRFError("bad_hostname", "hostname must not carry a path, query or credentials")
        text = parts.netloc
    if any(c in text for c in "/?#@ \t"):
        raise SSRFError("bad_hostname", "hostname must not contain a path or credentials")
    name, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise SSRFError("bad_hostname", "unterminated IPv6 literal")
        name, rest = text[: end + 1], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise SSRFError("bad_hostname", "junk after IPv6 literal")
            port = rest[1:]
    elif text.count(":") == 1:
        name, port = text.split(":")
    elif text.count(":") > 1:
        raise SSRFError("bad_hostname", "IPv6 literals must be bracketed")
    if port is not None:
        if not allow_insecure:
            raise SSRFError("port_not_allowed", "hostnames with a port need RELAY_ALLOW_INSECURE_HOSTS")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise SSRFError("bad_hostname", f"bad port {port!r}")
    name = name.rstrip(".")
    if _is_ip_literal(name):
        if not allow_insecure:
            raise SSRFError("ip_literal", "IP addresses are not hostnames")
    elif name in _BLOCKED_NAMES or name.endswith(".localhost"):
        if not allow_insecure:
            raise SSRFError("non_public_address", f"{name} is a loopback name")
    else:
        labels = name.split(".")
        if not all(_LABEL.match(label) for label in labels):
            raise SSRFError("bad_hostname", f"invalid hostname syntax {name!r}")
        if not allow_insecure and (len(labels) < 2 or labels[-1].isdigit()):
            raise SSRFError("bad_hostname", f"{name!r} is not a fully qualified public name")
    return f"{name}:{port}" if port is not None else name


def split_host_port(hostname: str) -> tuple[str, int | None]:
    """``example.com:8080`` → (``example.com``, 8080); brackets are removed from IPv6."""
    if hostname.startswith("["):
        end = hostname.index("]")
        rest = hostname[end + 1:]
        return hostname[1:end], int(rest[1:]) if rest.startswith(":") else None
    if hostname.count(":") == 1:
        host, port = hostname.split(":")
        return host, int(port)
    return hostname, None


class AddressGuard:
    """Resolves names and refuses non-public destinations (unless ``allow_insecure``)."""

    def __init__(self, *, allow_insecure: bool = False, resolver: Resolver | None = None) -> None:
        self.allow_insecure = allow_insecure
        self.resolver = resolver or system_resolver

    async def check_host(self, host: str) -> list[str]:
        """Every address of ``host`` must be public; returns them. IP literals are checked as is."""
        host = host.strip("[]").rstrip(".").lower()
        if _is_ip_literal(host):
            addrs = [host]
        elif host in _BLOCKED_NAMES or host.endswith(".localhost"):
            if self.allow_insecure:
                return ["127.0.0.1"]
            raise SSRFError("non_public_address", f"{host} is a loopback name")
        else:
            addrs = await self.resolver(host)
            if not addrs:
                raise SSRFError("dns_failure", f"{host} has no addresses")
        if not self.allow_insecure:
            for addr in addrs:
                if not is_public_address(addr):
                    raise SSRFError("non_public_address", f"{host} resolves to non-public {addr}")
        return addrs

    async def connect_address(self, host: str) -> str:
        """The one address to connect to for ``host``: checked like :meth:`check_host` (raises
        ``SSRFError``), IPv4 preferred. Connect to it, not to the name, so the name cannot be
        re-resolved somewhere else between check and connection."""
        addrs = await self.check_host(host)
        return next((a for a in addrs if ":" not in a), addrs[0])

    async def check_url(self, url: str, *, resolve: bool = True) -> None:
        """Scheme, port and destination checks for one request URL (the destination only when
        ``resolve``: a pinned connection checks it when it connects)."""
        parts = urlsplit(url)
        if parts.scheme not in ("https", "wss", "http", "ws") or not parts.hostname:
            raise SSRFError("bad_url", f"unsupported URL {url!r}")
        if parts.scheme in ("http", "ws") and not self.allow_insecure:
            raise SSRFError("insecure_scheme", f"{parts.scheme}:// needs RELAY_ALLOW_INSECURE_HOSTS")
        if parts.username or parts.password:
            raise SSRFError("bad_url", "credentials in URL")
        if resolve:
            await self.check_host(parts.hostname)


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend that connects only to addresses the guard vetted at that moment."""

    def __init__(self, guard: AddressGuard, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._guard = guard
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        addrs = await self._guard.check_host(host)
        addrs = sorted(addrs, key=lambda a: ":" in a)[:4]  # IPv4 first; a few tries at most
        error: Exception | None = None
        for addr in addrs:
            try:
                return await self._inner.connect_tcp(addr, port, timeout=timeout, local_address=local_address,
                                                      socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise SSRFError("bad_url", "unix sockets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over :class:`_GuardedBackend`: no proxies from the environment (they
    would bypass the address check), TLS verified against the request's host name."""

    def __init__(self, guard: AddressGuard, backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        super().__init__(retries=0, trust_env=False)
        limits = httpx.Limits()
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_GuardedBackend(guard, backend),
        )


class _GuardedTransport(httpx.AsyncBaseTransport):
    """Checks each request's URL (so every redirect hop) before handing it to the real transport;
    when that transport pins its connections (``pinned``), the address check happens there."""

    def __init__(self, guard: AddressGuard, inner: httpx.AsyncBaseTransport, *, pinned: bool) -> None:
        self._guard = guard
        self._inner = inner
        self._pinned = pinned

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self._guard.check_url(str(request.url), resolve=not self._pinned)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class SafeClient:
    """An httpx client whose every hop passes the ``AddressGuard``; bodies are size-limited."""

    def __init__(self, guard: AddressGuard, *, timeout: float = 10.0, max_redirects: int = 3,
                 user_agent: str = "atproto-relay (python)",
                 inner_transport: httpx.AsyncBaseTransport | None = None,
                 network_backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        """``inner_transport`` replaces the network (tests stand in for the public internet; the
        guard then checks each URL's addresses up front); ``network_backend`` replaces only the
        sockets under the pinned transport."""
        self.guard = guard
        pinned = inner_transport is None
        inner = inner_transport or _PinnedTransport(guard, network_backend)
        self._client = httpx.AsyncClient(
            transport=_GuardedTransport(guard, inner, pinned=pinned),
            trust_env=False,  # no proxy from the environment: it would connect in our place
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            follow_redirects=True,
            max_redirects=max_redirects,
            headers={"user-agent": user_agent},
        )

    async def get(self, url: str, *, max_bytes: int = 1 << 20, params: Mapping[str, str] | None = None,
                  headers: Mapping[str, str] | None = None) -> tuple[int, bytes, httpx.Headers]:
        """GET ``url``; returns (status, body, headers). Raises ``SSRFError``/``httpx.HTTPError``."""
        async with self._client.stream("GET", url, params=params, headers=headers) as resp:
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise SSRFError("too_large", f"{url}: {declared} bytes exceeds {max_bytes}")
            chunks: list[bytes] = []
            total = 0
            async for chunk in resp.aiter_bytes():
                total += len(chunk)
                if total > max_bytes:
                    raise SSRFError("too_large", f"{url}: body exceeds {max_bytes} bytes")
                chunks.append(chunk)
            return resp.status_code, b"".join(chunks), resp.headers

    async def aclose(self) -> None:
        await self._client.aclose()
