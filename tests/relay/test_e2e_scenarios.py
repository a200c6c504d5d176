"""indigo's relay scenarios (../shared/fixtures/indigo-relay-scenarios) through the black-box relay.

A test upstream (a real WebSocket server on 127.0.0.1) plays each scenario's frames; a test PLC
serves the scenario accounts' DID documents (their PDS endpoint pointing at the test upstream)
and resolves their handles. A consumer on the relay's subscribeRepos must receive exactly the
frames not marked ``drop``, in order, equal in every field indigo's runner compares.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from firehose.frames import encode_frame
from mst.datamodel import json_to_data
from tests.relay.e2e import Consumer, crawl
from tests.relay.helpers import serve_asgi

#: Fields indigo's runner compares per message type (seq and time are the relay's own).
COMPARED = {
    "#commit": ("repo", "commit", "blocks", "blobs", "ops", "since", "prevData", "rebase", "rev", "tooBig"),
    "#sync": ("did", "blocks", "rev"),
    "#identity": ("did", "handle"),
    "#account": ("did", "active", "status"),
}


class ScenarioUpstream:
    """Serves the scenario frames on subscribeRepos (honouring the cursor) plus describeServer."""

    def __init__(self, frames: list[tuple[int, bytes]]) -> None:
        self.frames = frames
        self.hostname = ""

    async def _stream(self, ws: ServerConnection) -> None:
        cursor = int(ws.request.path.partition("cursor=")[2] or 0) if ws.request else 0
        for seq, frame in self.frames:
            if seq > cursor:
                await ws.send(frame)
        await ws.wait_closed()

    def _http(self, connection: ServerConnection, request: WsRequest) -> WsResponse | None:
        if request.path.startswith("/xrpc/com.atproto.server.describeServer"):
            return connection.respond(200, json.dumps({"did": "did:web:upstream.test"}))
        if request.path.startswith("/xrpc/com.atproto.sync.subscribeRepos"):
            return None
        return connection.respond(404, "{}")

    async def __aenter__(self) -> ScenarioUpstream:
        self._server = await serve(self._stream, "127.0.0.1", 0, process_request=self._http)
        self.hostname = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()


def _plc_app(accounts: list[dict[str, Any]], pds_url: str) -> Starlette:
    docs: dict[str, dict[str, Any]] = {}
    handles: dict[str, str] = {}
    for account in accounts:
        ident = account["identity"]
        did = ident["did"]
        key = ident["keys"]["atproto"]
        docs[did] = {
            "id": did,
            "alsoKnownAs": ident.get("alsoKnownAs", []),
            "verificationMethod": [{"id": f"{did}#atproto", "type": key["type"], "controller": did,
                                    "publicKeyMultibase": key["publicKeyMultibase"]}],
            "service": [{"id": "#atproto_pds", "type": "AtprotoPersonalDataServer", "serviceEndpoint": pds_url}],
        }
        if ident.get("handle"):
            handles[ident["handle"]] = did

    async def doc(request: Request) -> JSONResponse:
        found = docs.get(request.path_params["did"])
        return JSONResponse(found) if found else JSONResponse({"message": "not found"}, status_code=404)

    async def resolve_handle(request: Request) -> JSONResponse:
        did = handles.get(request.query_params.get("handle", ""))
        return JSONResponse({"did": did}) if did else JSONResponse({"error": "InvalidRequest"}, status_code=400)

    return Starlette(routes=[Route("/xrpc/com.atproto.identity.resolveHandle", resolve_handle),
                             Route("/{did}", doc)])


@pytest.mark.parametrize("name", ["account_lifecycle", "post_lifecycle"])
async def test_indigo_scenario(name: str, fixtures_dir: Path, relay_factory) -> None:  # type: ignore[no-untyped-def]
    scenario = json.loads((fixtures_dir / "indigo-relay-scenarios" / f"{name}.json").read_text())
    messages = scenario["messages"]
    frames = []
    for msg in messages:
        body = json_to_data(msg["frame"]["body"])
        frames.append((body["seq"], encode_frame(msg["frame"]["header"]["t"], body)))
    expected = [(m["frame"]["header"]["t"], json_to_data(m["frame"]["body"])) for m in messages if not m["drop"]]
    async with ScenarioUpstream(frames) as upstream:
        async with serve_asgi(_plc_app(scenario["accounts"], f"http://{upstream.hostname}")) as plc_url:
            async with relay_factory(allow_insecure_hosts=True, plc_url=plc_url, handle_resolver_url=plc_url,
                                     validation_workers=0) as relay:
                async with Consumer(relay.ws_url, cursor=0) as consumer:
                    await crawl(relay.url, upstream.hostname)
                    await consumer.wait_for(lambda evs: len(evs) >= len(expected), timeout=20)
                    await asyncio.sleep(0.5)  # a dropped frame arriving late would show up here
    got = consumer.events
    assert [e.t for e in got] == [t for t, _ in expected]
    for event, (t, body) in zip(got, expected, strict=True):
        for field in COMPARED[t]:
            assert event.body.get(field) == body.get(field), (t, field)
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
