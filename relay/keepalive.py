"""A small HTTP/1.1 GET client for one trusted origin (the PLC directory): the identity resolver's
hot path when many accounts are seen for the first time.

Why not httpx here: its connection pool re-checks every pooled connection (a ``poll`` per
connection) each time a request is queued, assigned or finished, which made it ~2/3 of the relay
main process's CPU on never-seen accounts (``bench/growth.py``). This client keeps idle
connections on a stack (most recently used first) and checks nothing until it uses one: a request
is one write and a few reads on an asyncio stream.

Scope, on purpose: GET only, to the origin of ``base_url`` (an operator setting, so not
SSRF-checked); ``Content-Length``, chunked and close-delimited bodies; a body over ``max_bytes``,
a malformed response or a timeout raise ``HttpError`` and drop the connection. A request on a
reused connection that the server had already closed is retried once on a new one (GET is
idempotent; nothing of the response had arrived).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024


class HttpError(Exception):
    """The request failed (connection, timeout, malformed or oversized response)."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the response."""


class KeepAliveClient:
    """``await get(target, max_bytes=…) -> (status, body)`` against ``base_url``'s origin, over at
    most ``max_connections`` keep-alive connections; ``timeout`` bounds each request."""

    def __init__(self, base_url: str, *, max_connections: int = 16, timeout: float = 10.0,
                 user_agent: str = "atproto-relay (python)") -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        default_port = self.port == (443 if self.ssl else 80)
        host_header = self.host if default_port else f"{self.host}:{self.port}"
        if ":" in self.host and not default_port:  # IPv6 literal
            host_header = f"[{self.host}]:{self.port}"
        self._head = (f"Host: {host_header}\r\nUser-Agent: {user_agent}\r\n"
                      "Accept: application/json\r\n\r\n").encode("latin-1")
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

    async def get(self, target: str, *, max_bytes: int) -> tuple[int, bytes]:
        """GET ``base_url`` path + ``target`` (which starts with ``/``)."""
        if self._closed:
            raise HttpError("client closed")
        request = f"GET {self.prefix}{target} HTTP/1.1\r\n".encode("latin-1") + self._head
        async with self._slots:
            try:
                async with asyncio.timeout(self.timeout):
                    while self._idle:
                        conn = self._idle.pop()
                        try:
                            return await self._exchange(conn, request, max_bytes, reused=True)
                        except _Stale:
                            continue
                    reader, writer = await asyncio.open_connection(
                        self.host, self.port, ssl=self.ssl, limit=MAX_HEAD,
                        server_hostname=self.host if self.ssl else None)
                    return await self._exchange(_Conn(reader, writer), request, max_bytes, reused=False)
            except TimeoutError:
                raise HttpError(f"no answer within {self.timeout:g}s") from None
            except _Stale:
                raise HttpError("connection closed by the server") from None
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                raise HttpError(f"{type(exc).__name__}: {exc}") from None

    async def _exchange(self, conn: _Conn, request: bytes, max_bytes: int, *, reused: bool) -> tuple[int, bytes]:
        keep = False
        try:
            conn.writer.write(request)
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _Stale from None
                raise
            status, headers, keep = _parse_head(head)
            while 100 <= status < 200:  # interim responses (e.g. 103) precede the real one
                status, headers, keep = _parse_head(await conn.reader.readuntil(b"\r\n\r\n"))
            body, delimited = await _read_body(conn.reader, headers, status, max_bytes)
            keep = keep and delimited
            return status, body
        except _Stale:
            if not reused:
                raise HttpError("connection closed by the server") from None
            raise
        finally:
            if keep and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, lower-cased headers, and whether the connection may be reused."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise HttpError(f"malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpError("malformed header line")
            headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return int(code), headers, keep


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], status: int,
                     max_bytes: int) -> tuple[bytes, bool]:
    """The body, and whether its end was delimited (so the connection can carry another request)."""
    if status in (204, 304):
        return b"", True
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks: list[bytes] = []
        size = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                n = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError("malformed chunk size") from None
            if n == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return b"".join(chunks), True
            size += n
            if size > max_bytes:
                raise HttpError(f"body over {max_bytes} bytes")
            chunks.append(await reader.readexactly(n))
            if await reader.readexactly(2) != b"\r\n":
                raise HttpError("malformed chunk")
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HttpError("malformed Content-Length")
        if int(length) > max_bytes:
            raise HttpError(f"body over {max_bytes} bytes")
        return await reader.readexactly(int(length)), True
    body = await reader.read(max_bytes + 1)  # delimited by the connection's end
    while body and len(body) <= max_bytes:
        more = await reader.read(max_bytes + 1 - len(body))
        if not more:
            break
        body += more
    if len(body) > max_bytes:
        raise HttpError(f"body over {max_bytes} bytes")
    return body, False
