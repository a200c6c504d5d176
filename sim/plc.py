"""A PLC-directory stand-in: ``GET /{did}`` returns the DID document of any simulated account.

It also answers ``/xrpc/com.atproto.identity.resolveHandle?handle=…`` for the simulated handles,
so a relay can verify handles without DNS (``--handle-resolver-url`` = the PLC URL).

Weather (``sim.weather``): ``delay`` (every document, a :class:`Delay` distribution) and
``did_delays[did]`` (one DID's, instead of the global one) hold each answer back; a document
is read when the request arrives, so an answer sent late is the document as it was then (as a
slow directory would serve it). ``did_failures[did]`` (or ``failure`` for every DID) answers
with that HTTP status instead. ``resolveHandle`` answers after the handle's delay and fails for
a failing handle (``domains.weather``).

A small HTTP/1.1 server on raw asyncio streams with keep-alive, so a relay resolving thousands of
identities reuses its connections as it would with the real directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import random
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sim.weather import Delay, HandleDomains

MAX_HEAD = 16_384


class SimPLC:
    """Serves ``docs[did]`` at ``/{did}``; documents are replaced in place on rotation/migration."""

    def __init__(self, domains: HandleDomains | None = None, *, seed: int = 0) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.domains = domains if domains is not None else HandleDomains()
        #: handle -> DID (the same dict as ``domains.dids``)
        self.handles: dict[str, str] = self.domains.dids
        self.delay: Delay | None = None
        self.did_delays: dict[str, Delay] = {}
        self.failure: int | None = None
        self.did_failures: dict[str, int] = {}
        self.rng = random.Random(seed)
        #: document requests, by DID (``requests`` counts every request)
        self.doc_requests: dict[str, int] = {}
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
        """Status and JSON body for a GET of ``target`` (at once, without the weather)."""
        return self._route(target)[:2]

    def _route(self, target: str) -> tuple[int, dict[str, Any], float]:
        """Status, JSON body and how long to hold the answer back."""
        parts = urlsplit(target)
        path = parts.path
        if path == "/xrpc/com.atproto.identity.resolveHandle":
            params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            handle = params.get("handle", "").lower()
            found = self.domains.answer(handle)
            delay = self.domains.delay_of(handle)
            if found is None:
                return 400, {"error": "HandleNotFound", "message": "unknown handle"}, delay
            return 200, {"did": found}, delay
        did = path.lstrip("/")
        if did.endswith("/data"):
            did = did[: -len("/data")]
        self.doc_requests[did] = self.doc_requests.get(did, 0) + 1
        dist = self.did_delays.get(did, self.delay)
        delay = dist.sample(self.rng) if dist is not None else 0.0
        failure = self.did_failures.get(did, self.failure)
        if failure is not None:
            return failure, {"error": "InternalServerError", "message": "directory failing"}, delay
        doc = self.docs.get(did)
        if doc is None:
            return 404, {"error": "NotFound", "message": f"DID not registered: {did[:100]}"}, delay
        return 200, doc, delay

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
                delay = 0.0
                if method not in ("GET", "HEAD"):
                    status, body = 405, {"error": "MethodNotAllowed", "message": method[:20]}
                else:
                    status, body, delay = self._route(target)
                if delay > 0:
                    await asyncio.sleep(delay)
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
