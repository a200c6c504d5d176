"""A PLC-directory stand-in: ``GET /{did}`` returns the DID document of any simulated account.

It also answers ``/xrpc/com.atproto.identity.resolveHandle?handle=…`` for the simulated handles,
so a relay can verify handles without DNS (``--handle-resolver-url`` = the PLC URL).

A small HTTP/1.1 server on raw asyncio streams with keep-alive, so a relay resolving thousands of
identities reuses its connections as it would with the real directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

MAX_HEAD = 16_384


class SimPLC:
    """Serves ``docs[did]`` at ``/{did}``; documents are replaced in place on rotation/migration."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.handles: dict[str, str] = {}
        self.requests = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD)
        sock_port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{sock_port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    def route(self, target: str) -> tuple[int, dict[str, Any]]:
        """Status and JSON body for a GET of ``target``."""
        parts = urlsplit(target)
        path = parts.path
        if path == "/xrpc/com.atproto.identity.resolveHandle":
            params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            found = self.handles.get(params.get("handle", "").lower())
            if found is None:
                return 400, {"error": "HandleNotFound", "message": "unknown handle"}
            return 200, {"did": found}
        did = path.lstrip("/")
        if did.endswith("/data"):
            did = did[: -len("/data")]
        doc = self.docs.get(did)
        if doc is None:
            return 404, {"error": "NotFound", "message": f"DID not registered: {did[:100]}"}
        return 200, doc

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0") or 0)
                if length:
                    await reader.readexactly(length)
                self.requests += 1
                if method not in ("GET", "HEAD"):
                    status, body = 405, {"error": "MethodNotAllowed", "message": method[:20]}
                else:
                    status, body = self.route(target)
                data = json.dumps(body).encode()
                keep = version.strip() == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
                writer.write(
                    f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n".encode()
                    + (b"" if method == "HEAD" else data)
                )
                await writer.drain()
                if not keep:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()
