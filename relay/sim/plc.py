"""A PLC-directory stand-in: ``GET /{did}`` returns the DID document of any simulated account.

It also answers ``/xrpc/com.atproto.identity.resolveHandle?handle=…`` for the simulated handles,
so a relay can verify handles without DNS (``--handle-resolver-url`` = the PLC URL).
"""

from __future__ import annotations

from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from relay.sim.http import json_response, split_request, xrpc_error


class SimPLC:
    """Serves ``docs[did]`` at ``/{did}``; documents are replaced in place on rotation/migration."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.handles: dict[str, str] = {}
        self.requests = 0
        self._server: Server | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = await serve(self._reject_ws, host, port, process_request=self._http)
        sock_port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{sock_port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _reject_ws(self, ws: ServerConnection) -> None:  # pragma: no cover - never upgraded
        await ws.close()

    def _http(self, connection: ServerConnection, request: Request) -> Response:
        self.requests += 1
        path, params = split_request(request)
        if path == "/xrpc/com.atproto.identity.resolveHandle":
            found = self.handles.get(params.get("handle", "").lower())
            if found is None:
                return xrpc_error(400, "HandleNotFound", "unknown handle")
            return json_response({"did": found})
        did = path.lstrip("/")
        if did.endswith("/data"):
            did = did[: -len("/data")]
        doc = self.docs.get(did)
        if doc is None:
            return xrpc_error(404, "NotFound", f"DID not registered: {did}")
        return json_response(doc)
