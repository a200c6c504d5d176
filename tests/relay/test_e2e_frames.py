"""The exact bytes the relay emits for accepted commits.

An upstream (real WebSocket server on 127.0.0.1) sends signed ``#commit`` frames carrying fields
the lexicon does not define (top level and inside ops) and its own ``seq``. A raw consumer on the
relay's subscribeRepos must receive, for each, exactly the canonical DAG-CBOR frame of the
lexicon fields with the relay's ``seq`` — with validation inline and in worker processes (where
the body is encoded by the worker and ``seq`` spliced in by the sequencer).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.client import connect

from firehose.frames import decode_frame, encode_frame
from mst.crypto import PrivateKey
from mst.repo import Repo, Write
from tests.firehose.commits import commit_body
from tests.relay.e2e import crawl
from tests.relay.helpers import serve_asgi
from tests.relay.test_e2e_scenarios import ScenarioUpstream, _plc_app

#: com.atproto.sync.subscribeRepos#commit properties (seq aside) and #repoOp properties.
COMMIT_FIELDS = ("rebase", "tooBig", "repo", "commit", "rev", "since", "blocks", "ops", "blobs", "prevData", "time")
OP_FIELDS = ("action", "path", "cid", "prev")


def _upstream_commits(repo: Repo, n: int) -> list[dict[str, Any]]:
    bodies = [commit_body(repo, repo.genesis, seq=1000)]
    for i in range(n):
        res = repo.apply_writes([Write("create", "app.bsky.feed.post", f"3kabc{i:08d}",
                                       {"$type": "app.bsky.feed.post", "text": f"post {i}",
                                        "createdAt": "2026-01-01T00:00:00.000Z"})])
        bodies.append(commit_body(repo, res, seq=1001 + i))
    for i, body in enumerate(bodies):
        if i % 2:
            continue  # every other commit is plain lexicon
        body["zzUnknown"] = {"nested": [1, 2, 3]}  # sorts after every lexicon field
        body["aa"] = "x"  # sorts before seq
        body["unknownField"] = i
        for op in body["ops"]:
            op["junk"] = b"\x00" * 8
    return bodies


def _expected_body(upstream: dict[str, Any], seq: int) -> dict[str, Any]:
    body = {k: upstream[k] for k in COMMIT_FIELDS if k in upstream}
    body["ops"] = [{k: op[k] for k in OP_FIELDS if k in op} for op in upstream["ops"]]
    body["seq"] = seq
    return body


@pytest.mark.parametrize("workers", [0, 1])
async def test_accepted_commit_frames_are_canonical_lexicon_bodies(relay_factory, workers: int) -> None:  # type: ignore[no-untyped-def]
    did = "did:plc:framesbytesexact0000001"
    key = PrivateKey.generate_k256()
    repo = Repo.create(did, key)
    bodies = _upstream_commits(repo, 4)
    frames = [(b["seq"], encode_frame("#commit", b)) for b in bodies]
    account = {"identity": {"did": did, "handle": None, "alsoKnownAs": [],
                            "keys": {"atproto": {"type": "Multikey",
                                                 "publicKeyMultibase": key.did_key().removeprefix("did:key:")}}}}
    raw: list[bytes] = []
    async with ScenarioUpstream(frames) as upstream:
        async with serve_asgi(_plc_app([account], f"http://{upstream.hostname}")) as plc_url:
            async with relay_factory(allow_insecure_hosts=True, plc_url=plc_url,
                                     validation_workers=workers) as relay:
                async with connect(f"{relay.ws_url}?cursor=0", max_size=None) as ws:
                    await crawl(relay.url, upstream.hostname)
                    async with asyncio.timeout(30):
                        while len(raw) < len(bodies):
                            msg = await ws.recv()
                            assert isinstance(msg, bytes)
                            if decode_frame(msg).t == "#commit":
                                raw.append(msg)
    seqs = [decode_frame(f).body["seq"] for f in raw]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(s < 1000 for s in seqs)  # the relay's own numbering, not the upstream's
    for frame, upstream_body, seq in zip(raw, bodies, seqs, strict=True):
        assert frame == encode_frame("#commit", _expected_body(upstream_body, seq))
        got = decode_frame(frame).body
        assert not {"zzUnknown", "aa", "unknownField"} & got.keys()
        assert all(set(op) <= set(OP_FIELDS) for op in got["ops"])
        assert got["blocks"] == upstream_body["blocks"]
