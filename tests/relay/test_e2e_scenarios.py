"""indigo's relay scenarios (../shared/fixtures/indigo-relay-scenarios) through the black-box relay.

A test upstream (a real WebSocket server on 127.0.0.1) plays each scenario's frames; a test PLC
serves the scenario accounts' DID documents (their PDS endpoint pointing at the test upstream)
and resolves their handles. A consumer on the relay's subscribeRepos must receive exactly the
frames not marked ``drop``, in order, equal in every field indigo's runner compares. Each
scenario runs in strict and in lenient mode (``tests.firehose.scenario_cases`` says what each mode
must drop), and the consumer's check waits until the relay has settled every frame it read, so a
dropped frame that was stored after all would be seen.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
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
from tests.firehose.scenario_cases import MODES, RELAY_CASE_NAMES, Case, cases
from tests.relay.conftest import RunningRelay
from tests.relay.e2e import Consumer, crawl, metric_value
from tests.relay.helpers import serve_asgi
from tests.waiting import until

#: Fields indigo's runner compares per message type (seq and time are the relay's own).
COMPARED = {
    "#commit": ("repo", "commit", "blocks", "blobs", "ops", "since", "prevData", "rebase", "rev", "tooBig"),
    "#sync": ("did", "blocks", "rev"),
    "#identity": ("did", "handle"),
    "#account": ("did", "active", "status"),
}


class ScenarioUpstream:
    """Serves the scenario frames on subscribeRepos (honouring the cursor) plus describeServer;
    with ``hold`` only once ``release()`` was called."""

    def __init__(self, frames: list[tuple[int, bytes]], *, hold: bool = False) -> None:
        self.frames = frames
        self.hostname = ""
        self._released = asyncio.Event()
        if not hold:
            self._released.set()

    def release(self) -> None:
        self._released.set()

    async def _stream(self, ws: ServerConnection) -> None:
        cursor = int(ws.request.path.partition("cursor=")[2] or 0) if ws.request else 0
        await self._released.wait()
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


async def _settled(relay: RunningRelay, hostname: str, last_seq: int) -> int:
    """Wait until the relay has read ``hostname``'s stream up to ``last_seq`` and settled every
    frame (sequenced or dropped); returns the relay's latest seq then."""
    upstreams = relay.service.upstreams
    assert upstreams is not None
    await until(lambda: (upstreams.last_read(hostname) or 0) >= last_seq, f"the relay to read {hostname}")
    await upstreams.settle_read(hostname)
    return await relay.service.store.latest_seq()


async def _play(case: Case, mode: str, relay_factory, *, lenient: bool, host_lenient: bool | None = None,
                **settings: object) -> None:  # type: ignore[no-untyped-def]
    """Play ``case`` to a relay (lenient or not; ``host_lenient`` set through the admin API before
    the host sends anything) and check a consumer receives exactly the frames ``mode`` does not
    drop, and every lenient accept is counted under its own reason."""
    messages, drop = case.messages, case.drop[mode]
    lenient_accepts = Counter(r for r in case.reasons[mode] if r is not None and r.startswith("lenient_"))
    frames = []
    for msg in messages:
        body = json_to_data(msg["frame"]["body"])
        frames.append((body["seq"], encode_frame(msg["frame"]["header"]["t"], body)))
    expected = [(m["frame"]["header"]["t"], json_to_data(m["frame"]["body"]))
                for m, dropped in zip(messages, drop, strict=True) if not dropped]
    async with ScenarioUpstream(frames, hold=host_lenient is not None) as upstream:
        async with serve_asgi(_plc_app(case.accounts, f"http://{upstream.hostname}")) as plc_url:
            async with relay_factory(allow_insecure_hosts=True, plc_url=plc_url, handle_resolver_url=plc_url,
                                     validation_workers=0, lenient_sync_validation=lenient, admin_token="t",
                                     **settings) as relay:
                async with Consumer(relay.ws_url, cursor=0) as consumer:
                    await crawl(relay.url, upstream.hostname)
                    if host_lenient is not None:
                        async with httpx.AsyncClient(base_url=relay.url, headers={"authorization": "Bearer t"}) as http:
                            r = await http.post(f"/admin/hosts/{upstream.hostname}/validation",
                                                json={"lenient": host_lenient})
                            assert r.status_code == 200 and r.json()["lenientEffective"] is host_lenient, r.text
                            listed = (await http.get("/admin/hosts")).json()["hosts"]
                            assert [h["lenient"] for h in listed] == [host_lenient]  # stored with the host
                        upstream.release()
                    latest = await _settled(relay, upstream.hostname, frames[-1][0])
                    await consumer.wait_for(lambda evs: len(evs) >= len(expected) and (latest == 0 or
                                                                                     evs[-1].seq >= latest))
                    async with httpx.AsyncClient(base_url=relay.url) as http:
                        text = (await http.get("/metrics")).text
                    for reason in ("lenient_no_prev_data", "lenient_no_op_prev"):
                        counted = metric_value(text, "relay_verdicts_total", kind="accept", reason=reason)
                        assert counted == lenient_accepts[reason], (reason, counted)
    got = consumer.events
    assert [e.t for e in got] == [t for t, _ in expected]
    for event, (t, body) in zip(got, expected, strict=True):
        for field in COMPARED[t]:
            assert event.body.get(field) == body.get(field), (t, field)
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RELAY_CASE_NAMES)
async def test_indigo_scenario(name: str, mode: str, fixtures_dir: Path, relay_factory) -> None:  # type: ignore[no-untyped-def]
    """Each scenario (indigo's two, their sync 1.0 variants and the chain gaps) in strict and in lenient mode."""
    case = cases(fixtures_dir)[name]
    await _play(case, mode, relay_factory, lenient=mode == "lenient")


@pytest.mark.parametrize("host_lenient", [True, False])
async def test_lenient_mode_per_host_through_the_admin_api(host_lenient: bool, fixtures_dir: Path,
                                                            relay_factory) -> None:  # type: ignore[no-untyped-def]
    """The host's own setting wins over the relay's, both ways."""
    case = cases(fixtures_dir)["sync10_no_prev_data"]
    mode = "lenient" if host_lenient else "strict"
    await _play(case, mode, relay_factory, lenient=not host_lenient, host_lenient=host_lenient)
