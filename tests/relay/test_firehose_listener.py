"""``RELAY_FIREHOSE_BIND``: subscribeRepos from a plain websockets listener beside the main port.

Both endpoints serve the same broadcaster, so a consumer sees the same frames (bytes) in the same
order on either; the fast listener's consumers appear in the admin registry like any other.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from websockets.asyncio.client import connect

from firehose.state import PendingEvent
from relay.config import ConfigError, RelayConfig

DID = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"


async def _recv(ws, n: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [await asyncio.wait_for(ws.recv(), 5) for _ in range(n)]


async def test_fast_listener_serves_the_same_stream(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with relay_factory(firehose_bind="127.0.0.1:0", admin_token="tok") as relay:
        service = relay.service
        assert service.firehose_url is not None
        fast_url = service.firehose_url + "/xrpc/com.atproto.sync.subscribeRepos"
        for i in range(3):
            await service.sequencer.submit(PendingEvent(kind="#identity", did=DID,
                                                        body={"did": DID, "time": f"2026-01-0{i + 1}T00:00:00Z"}))
        async with connect(relay.ws_url + "?cursor=0") as main_ws, connect(fast_url + "?cursor=0") as fast_ws:
            replayed_main, replayed_fast = await _recv(main_ws, 3), await _recv(fast_ws, 3)
            assert replayed_fast == replayed_main
            async with httpx.AsyncClient(base_url=relay.url) as http:
                consumers = (await http.get("/admin/consumers", headers={"Authorization": "Bearer tok"})).json()
            assert len(consumers["consumers"]) == 2
            await service.sequencer.submit(PendingEvent(kind="#identity", did=DID,
                                                        body={"did": DID, "time": "2026-01-04T00:00:00Z"}))
            live_main, live_fast = await _recv(main_ws, 1), await _recv(fast_ws, 1)
            assert live_fast == live_main
        for _ in range(100):  # the registry entry goes when the connection does
            if len(service.consumers) == 0:
                break
            await asyncio.sleep(0.02)
        assert len(service.consumers) == 0
        async with httpx.AsyncClient() as http:
            text = (await http.get(relay.url + "/metrics")).text
        assert "relay_consumers 0.0" in text


async def test_fast_listener_refuses_other_paths_and_future_cursor(relay_factory) -> None:  # type: ignore[no-untyped-def]
    async with relay_factory(firehose_bind="127.0.0.1:0") as relay:
        base = relay.service.firehose_url
        assert base is not None
        http_base = base.replace("ws://", "http://")
        async with httpx.AsyncClient() as http:
            r = await http.get(http_base + "/xrpc/com.atproto.sync.listRepos",
                               headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                        "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert r.status_code == 404 and r.json()["error"] == "NotFound"
        async with connect(base + "/xrpc/com.atproto.sync.subscribeRepos?cursor=999") as ws:
            frame = await asyncio.wait_for(ws.recv(), 5)
        assert b"FutureCursor" in frame
        async with httpx.AsyncClient() as http:
            text = (await http.get(relay.url + "/metrics")).text
        assert 'relay_broadcast_events_total{event="future_cursor"} 1.0' in text
        assert 'relay_broadcast_events_total{event="too_slow"} 0.0' in text


def test_fast_listener_bind_is_validated() -> None:
    with pytest.raises(ConfigError, match="RELAY_FIREHOSE_BIND"):
        RelayConfig.from_env({"RELAY_FIREHOSE_BIND": "no-port"})
    assert RelayConfig.from_env({}).firehose_bind == ""
