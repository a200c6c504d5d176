"""SSRF check for outbound requests whose address comes from untrusted input (host names in the
relay's tables, PDS endpoints in DID documents). Pure, apart from the DNS lookup it performs.

Contract: ``check_url(url, allow_private=False) -> None`` raises ``SsrfError(reason)`` when the URL
is not ``http``/``https``, carries credentials, or any address its host resolves to is loopback,
private, link-local, multicast, reserved or unspecified (unless ``allow_private``). Reasons:
``bad_scheme``, ``bad_url``, ``userinfo_not_allowed``, ``unresolvable_host``, ``private_address``.

``relay.ssrf`` guards the relay's asyncio clients; Spark tasks are synchronous, so this is the
same address policy (``relay.ssrf.is_public_address``) for a blocking client.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from urllib.parse import urlsplit

from relay.ssrf import is_public_address


class SsrfError(Exception):
    """A refused outbound address; ``reason`` is a snake_case label."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


@lru_cache(maxsize=4096)
def _resolve(host: str, port: int) -> tuple[str, ...]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise SsrfError("unresolvable_host", host) from exc
    return tuple(sorted({info[4][0] for info in infos}))


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
