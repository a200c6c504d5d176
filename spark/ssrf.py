"""SSRF check for outbound requests whose address comes from untrusted input (host names in the
relay's tables, PDS endpoints in DID documents). Pure, apart from the DNS lookup it performs.

Contract: ``check_url(url, allow_private=False) -> None`` raises ``SsrfError(reason)`` when the URL
is not ``http``/``https``, carries credentials, or any address its host resolves to is loopback,
private, link-local, multicast, reserved or unspecified (unless ``allow_private``). Reasons:
``bad_scheme``, ``bad_url``, ``userinfo_not_allowed``, ``unresolvable_host``, ``private_address``.

``relay.ssrf`` guards the relay's asyncio clients; Spark tasks are synchronous, so this is the
same address policy (``relay.ssrf.is_public_address``) for a blocking client.

``pinned_transport(ssl_context, max_connections, allow_private)`` is the httpx transport the
fetchers use: every TCP connection goes to an address vetted at that moment (``GuardedBackend``),
never to a second, independent resolution of the name, so DNS rebinding between ``check_url`` and
the connection cannot reach a private address. TLS still verifies the certificate for the name.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

import httpcore
import httpx

from mst.errors import ReasonError
from relay.ssrf import is_public_address


class SsrfError(ReasonError):
    """A refused outbound address; ``reason`` is a snake_case label."""


@lru_cache(maxsize=4096)
def _resolve(host: str, port: int) -> tuple[str, ...]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise SsrfError("unresolvable_host", host) from exc
    return tuple(sorted({str(info[4][0]) for info in infos}))  # str() for the type: IP sockaddrs hold str


def check_url(url: str, allow_private: bool = False) -> None:
    """Raise ``SsrfError`` unless ``url`` may be fetched (see the module docstring)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SsrfError("bad_url", url) from exc
    if parts.scheme not in ("http", "https"):
        raise SsrfError("bad_scheme", parts.scheme)
    if parts.username is not None or parts.password is not None:
        raise SsrfError("userinfo_not_allowed")
    host = parts.hostname
    if not host:
        raise SsrfError("bad_url", url)
    if allow_private:
        return
    port = port or (443 if parts.scheme == "https" else 80)
    for addr in _resolve(host, port):
        if not is_public_address(addr.split("%", 1)[0]):
            raise SsrfError("private_address", host)


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore network backend: resolves the name itself, refuses non-public addresses (unless
    ``allow_private``) and connects to exactly the addresses it checked."""

    def __init__(self, allow_private: bool = False, inner: httpcore.NetworkBackend | None = None) -> None:
        self.allow_private = allow_private
        self._inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        addrs = _resolve(host, port)
        if not self.allow_private:
            for addr in addrs:
                if not is_public_address(addr.split("%", 1)[0]):
                    raise SsrfError("private_address", host)
        error: Exception | None = None
        for addr in sorted(addrs, key=lambda a: ":" in a)[:4]:  # IPv4 first, a few tries at most
            try:
                return self._inner.connect_tcp(addr, port, timeout=timeout, local_address=local_address,
                                               socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        if error is None:
            raise SsrfError("unresolvable_host", host)
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
                            ) -> httpcore.NetworkStream:
        raise SsrfError("bad_url", "unix sockets are not allowed")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _PinnedTransport(httpx.HTTPTransport):
    def __init__(self, ssl_context: ssl.SSLContext, max_connections: int, allow_private: bool,
                 backend: httpcore.NetworkBackend | None = None) -> None:
        super().__init__(verify=ssl_context, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            network_backend=GuardedBackend(allow_private, backend),
        )


def pinned_transport(ssl_context: ssl.SSLContext, max_connections: int, allow_private: bool = False,
                     backend: httpcore.NetworkBackend | None = None) -> httpx.HTTPTransport:
    """An httpx transport whose connections go only to addresses checked when connecting
    (``backend`` replaces the sockets: tests stand in for the public internet with it)."""
    return _PinnedTransport(ssl_context, max_connections, allow_private, backend)
