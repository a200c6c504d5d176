"""A bad frame costs only itself, through a running relay.

A test upstream (a real WebSocket server on 127.0.0.1) holds 10 valid signed ``#commit`` frames,
then one frame the relay cannot read, then 100 more valid commits of the same accounts. Asked for
a cursor it sends every frame after it; asked for none (live) it has nothing new, as a real host
whose backlog is behind it. A consumer on the relay's subscribeRepos must receive all 110
commits, each exactly once and in each account's order; the bad frame is counted by its reason,
and the host's stored cursor reaches the last upstream seq without ever being reset.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from firehose.frames import encode_frame
from firehose.reasons import Reason
from mst.crypto import PrivateKey
from mst.repo import Repo, Write
from tests.firehose.commits import commit_body
from tests.relay.e2e import Consumer, check_stream, crawl, metric_value
from tests.relay.helpers import serve_asgi
from tests.relay.test_e2e_scenarios import _plc_app
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

#: the relay's transport cap on one upstream message (``SubscriberConfig.max_message_bytes``)
TRANSPORT_CAP = 16_000_000


class BacklogUpstream:
    """Serves ``frames`` (seq, bytes) on subscribeRepos: everything after the asked cursor, nothing
    when asked for none; records every cursor asked for."""

    def __init__(self, frames: list[tuple[int, bytes]]) -> None:
        self.frames = frames
        self.hostname = ""
        self.cursors: list[int | None] = []
        self._server: Server | None = None

    async def _stream(self, ws: ServerConnection) -> None:
        asked = parse_qs(urlsplit(ws.request.path if ws.request else "").query).get("cursor")
        cursor = int(asked[0]) if asked else None
        self.cursors.append(cursor)
        if cursor is not None:
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

    async def __aenter__(self) -> BacklogUpstream:
        self._server = await serve(self._stream, "127.0.0.1", 0, process_request=self._http, max_size=None)
        self.hostname = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def _accounts(n: int) -> list[tuple[Repo, PrivateKey]]:
    out = []
    for i in range(n):
        key = PrivateKey.generate_k256()
        out.append((Repo.create(f"did:plc:badframeaccount{i:09d}", key), key))
    return out


def _commits(accounts: list[tuple[Repo, PrivateKey]], n: int) -> list[dict[str, Any]]:
    """``n`` commits, round robin over the accounts (each account's genesis first)."""
    bodies: list[dict[str, Any]] = []
    made = 0
    for repo, _ in accounts:
        bodies.append(commit_body(repo, repo.genesis))
    while len(bodies) < n:
        repo = accounts[made % len(accounts)][0]
        res = repo.apply_writes([Write("create", "app.bsky.feed.post", f"3kbad{made:08d}",
                                       {"$type": "app.bsky.feed.post", "text": f"post {made}",
                                        "createdAt": "2026-01-01T00:00:00.000Z"})])
        bodies.append(commit_body(repo, res))
        made += 1
    return bodies[:n]


def _unreadable(kind: str, seq: int) -> tuple[bytes, str]:
    """The bad frame at ``seq`` and the reason the relay must count for it."""
    if kind == "garbage":  # not CBOR at all
        return b"\xff\x00not a frame", Reason.BAD_HEADER_CBOR.value
    if kind == "bad_body":  # a valid header, a truncated body
        return encode_frame("#commit", {"seq": seq, "repo": "did:plc:x"})[:-4], Reason.BAD_BODY_CBOR.value
    # over the transport cap: the connection closes (1009) and the next one skips just it
    return (encode_frame("#commit", {"seq": seq, "blocks": b"\x00" * (TRANSPORT_CAP + 1000)}),
            Reason.FRAME_TOO_LARGE.value)


@pytest.mark.parametrize("kind", ["garbage", "bad_body", "oversized"])
async def test_an_unreadable_frame_costs_only_itself(relay_factory, kind: str) -> None:  # type: ignore[no-untyped-def]
    accounts = _accounts(4)
    bodies = _commits(accounts, 110)
    bad, reason = _unreadable(kind, 11)
    frames: list[tuple[int, bytes]] = []
    for i, body in enumerate(bodies):
        body["seq"] = i + 1 if i < 10 else i + 2  # upstream seqs 1..10, [11 is the bad one], 12..111
        frames.append((body["seq"], encode_frame("#commit", body)))
    frames.insert(10, (11, bad))
    plc_accounts = [{"identity": {"did": repo.did, "handle": None, "alsoKnownAs": [],
                                  "keys": {"atproto": {"type": "Multikey",
                                                       "publicKeyMultibase": key.did_key().removeprefix("did:key:")}}}}
                    for repo, key in accounts]
    expected = {repo.did: [b["rev"] for b in bodies if b["repo"] == repo.did] for repo, _ in accounts}
    async with BacklogUpstream(frames) as upstream:
        async with serve_asgi(_plc_app(plc_accounts, f"http://{upstream.hostname}")) as plc_url:
            async with relay_factory(allow_insecure_hosts=True, plc_url=plc_url, validation_workers=0) as relay:
                async with Consumer(relay.ws_url, cursor=0) as consumer:
                    await crawl(relay.url, upstream.hostname)
                    await consumer.wait_for(lambda evs: len([e for e in evs if e.t == "#commit"]) >= 110, timeout=60)
                    upstreams = relay.service.upstreams
                    assert upstreams is not None
                    # everything the host holds is read and settled; the consumer has it all
                    await until(lambda: upstreams.last_read(upstream.hostname) == 111, "the last frame read")
                    await upstreams.settle_read(upstream.hostname)
                    latest = await relay.service.store.latest_seq()
                    await consumer.wait_for(lambda evs: bool(evs) and evs[-1].seq >= latest)
                    cursor = await relay.service.store.host_cursor(upstream.hostname)
                    async with httpx.AsyncClient(base_url=relay.url) as http:
                        text = (await http.get("/metrics")).text
    commits = [e for e in consumer.events if e.t == "#commit"]
    check_stream(consumer.events)
    assert len(commits) == 110
    assert {did: [e.rev for e in commits if e.did == did] for did in expected} == expected
    assert metric_value(text, "relay_verdicts_total", kind="host", reason=reason) == 1
    assert metric_value(text, "relay_host_cursor_resets_total") == 0
    assert cursor == 111
    assert None not in upstream.cursors  # never "live from now": the backlog was read through
