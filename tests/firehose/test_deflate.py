"""permessage-deflate on subscribeRepos: offered only when enabled, and frames arrive intact."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect

from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus
from tests.firehose.conftest import Ingest, commit_frame
from tests.firehose.servers import serve, ws_url


@pytest.mark.parametrize("transport", ["asgi-batch", "websockets"])
@pytest.mark.parametrize("deflate", [True, False])
async def test_deflate_is_negotiated_only_when_enabled(store, transport: str, deflate: bool) -> None:  # type: ignore[no-untyped-def]
    bus = InProcessBus()
    ingest = Ingest(store, bus)
    await ingest.add(20, payload=b"compressible " * 50)
    b = Broadcaster(store, bus)
    await b.start()
    try:
        async with serve(b, transport, deflate=deflate) as hostport:
            async with connect(ws_url(hostport, 0), compression="deflate", max_size=None) as ws:
                negotiated = ws.response is not None and "permessage-deflate" in (
                    ws.response.headers.get("Sec-WebSocket-Extensions") or "")
                assert negotiated is deflate
                got = [await asyncio.wait_for(ws.recv(), 10) for _ in range(20)]
                live = asyncio.ensure_future(ws.recv())
                await ingest.add(1, payload=b"compressible " * 50)
                got.append(await asyncio.wait_for(live, 10))
        assert got == [commit_frame(s, b"compressible " * 50) for s in range(1, 22)]
    finally:
        await b.close()
        await ingest.close()
