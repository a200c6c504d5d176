"""Test helpers: read a simulated host's stream over a real WebSocket, and judge every frame the
way the relay does (``firehose.validate`` for the cryptography, the relay's per-host seq and
DID-document host checks around it), so tests can compare verdicts with ``fleet.ground_truth``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from firehose.frames import decode_frame
from firehose.state import AccountState
from firehose.validate import Verdict, validate_frame

SUBSCRIBE = "/xrpc/com.atproto.sync.subscribeRepos"


def ws_url(host_url: str, cursor: int | None = None) -> str:
    url = host_url.replace("http://", "ws://") + SUBSCRIBE
    return url if cursor is None else f"{url}?cursor={cursor}"


async def read_frames(host_url: str, cursor: int | None, *, idle: float = 0.5, limit: float = 20.0,
                      count: int | None = None) -> tuple[list[bytes], bool]:
    """Frames until ``count`` arrived, the stream is idle for ``idle`` s, or it closes.

    Returns ``(frames, closed_by_server)``; bounded by ``limit`` seconds overall.
    """
    frames: list[bytes] = []
    deadline = time.monotonic() + limit
    closed = False
    async with connect(ws_url(host_url, cursor), max_size=None, compression=None, open_timeout=5) as ws:
        while time.monotonic() < deadline and (count is None or len(frames) < count):
            try:
                msg = await asyncio.wait_for(ws.recv(), idle if count is None else deadline - time.monotonic())
            except TimeoutError:
                break
            except ConnectionClosed:
                closed = True
                break
            assert isinstance(msg, bytes)
            frames.append(msg)
    return frames, closed


@dataclass
class Judged:
    host: str
    seq: int | None
    kind: str | None
    did: str | None
    rev: str | None
    verdict: Verdict


class RelayJudge:
    """Judges frames host by host in arrival order, keeping account state like the relay.

    A ``desync`` verdict is followed by an immediate simulated resync to the commit that revealed
    the gap (the relay would fetch the repo; the test only needs the chain to continue).
    """

    def __init__(self, plc_url: str) -> None:
        self.plc_url = plc_url
        self.states: dict[str, AccountState] = {}
        self.keys: dict[str, tuple[str, str]] = {}  # did -> (did:key, pds url)
        self.last_seq: dict[str, int] = {}
        self.http = httpx.AsyncClient(timeout=5)

    async def close(self) -> None:
        await self.http.aclose()

    async def resolve(self, did: str, *, fresh: bool = False) -> tuple[str, str]:
        if fresh or did not in self.keys:
            doc = (await self.http.get(f"{self.plc_url}/{did}")).raise_for_status().json()
            vm = next(v for v in doc["verificationMethod"] if v["id"].endswith("#atproto"))
            svc = next(s for s in doc["service"] if s["id"] == "#atproto_pds")
            self.keys[did] = ("did:key:" + vm["publicKeyMultibase"], svc["serviceEndpoint"])
        return self.keys[did]

    async def judge(self, host_url: str, raw: bytes) -> Judged:
        host = host_url.removeprefix("http://")
        try:
            frame = decode_frame(raw)
        except Exception:
            return Judged(host, None, None, None, None, validate_frame(raw, None, None, time.time()))
        body = frame.body
        seq = body.get("seq")
        kind = frame.t
        did = body.get("repo") if kind == "#commit" else body.get("did")
        rev = body.get("rev")
        if isinstance(seq, int):
            if seq <= self.last_seq.get(host, 0):
                return Judged(host, seq, kind, did, rev, Verdict("ignore", "seq_not_increasing"))
            self.last_seq[host] = seq
        if kind == "#identity":
            await self.resolve(did, fresh=True)
        key, pds = await self.resolve(did, fresh=True) if kind == "#account" else await self.resolve(did)
        if pds != host_url:
            key, pds = await self.resolve(did, fresh=True)
            if pds != host_url:
                return Judged(host, seq, kind, did, rev, Verdict("reject", "wrong_host"))
        state = self.states.get(did)
        verdict = validate_frame(raw, state, key, time.time())
        if verdict.kind == "reject" and verdict.reason == "bad_signature":  # refresh once, retry
            key, _ = await self.resolve(did, fresh=True)
            verdict = validate_frame(raw, state, key, time.time())
        if verdict.new_state is not None:
            if verdict.kind == "desync":
                again = validate_frame(raw, None, key, time.time())
                assert again.kind == "accept", again
                self.states[did] = replace(again.new_state, upstream_status=self.states[did].upstream_status)
            else:
                self.states[did] = verdict.new_state
        return Judged(host, seq, kind, did, rev, verdict)
