"""Build valid ``#commit``/``#sync`` frames with the real producer (``mst.repo``), then tamper."""

from __future__ import annotations

import dataclasses
from typing import Any

from firehose.frames import encode_frame
from firehose.state import AccountState
from mst.car import read_car, write_car
from mst.cid import CID, cid_for_cbor
from mst.commit import Commit
from mst.crypto import PrivateKey
from mst.repo import CommitResult, Repo, Write
from mst.tid import TidClock

TIME = "2026-01-01T00:00:00.000Z"


def new_repo(did: str = "did:plc:validateaccount000000001", clock: TidClock | None = None) -> Repo:
    return Repo.create(did, PrivateKey.generate_k256(), clock)


def state_of(repo: Repo, r: CommitResult) -> AccountState:
    return AccountState(did=repo.did, rev=r.rev, commit_cid=r.commit_cid.encode(), data_cid=r.data.encode())


def posts(n: int, start: int = 0, text: str = "hello") -> list[Write]:
    return [Write("create", "app.bsky.feed.post", f"3k{start + i:011d}", {"text": f"{text} {i}", "$type": "app.bsky.feed.post"}) for i in range(n)]


def op_json(op) -> dict[str, Any]:
    d: dict[str, Any] = {"action": op.action, "path": op.path, "cid": op.cid}
    if op.prev is not None:
        d["prev"] = op.prev
    return d


def commit_body(repo: Repo, r: CommitResult, seq: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {
        "seq": seq,
        "rebase": False,
        "tooBig": False,
        "repo": repo.did,
        "commit": r.commit_cid,
        "rev": r.rev,
        "since": r.since,
        "blocks": r.car,
        "ops": [op_json(o) for o in r.ops],
        "blobs": [],
        "time": TIME,
    }
    if r.prev_data is not None:
        body["prevData"] = r.prev_data
    return body


def sync_body(repo: Repo, r: CommitResult, seq: int = 1) -> dict[str, Any]:
    car = write_car([r.commit_cid], [(r.commit_cid, r.blocks[r.commit_cid])])
    return {"seq": seq, "did": repo.did, "rev": r.rev, "blocks": car, "time": TIME}


def frame(body: dict[str, Any], t: str = "#commit") -> bytes:
    return encode_frame(t, body)


def replace_commit(body: dict[str, Any], commit: Commit) -> dict[str, Any]:
    """Swap the commit block (e.g. a tampered signature) and re-point root and ``commit``."""
    car = read_car(body["blocks"])
    old = car.roots[0]
    block = commit.encode()
    new = cid_for_cbor(block)
    blocks = [(c, b) for c, b in car.blocks.items() if c != old] + [(new, block)]
    return {**body, "commit": new, "blocks": write_car([new], blocks)}


def flip_sig(body: dict[str, Any]) -> dict[str, Any]:
    from mst.commit import decode_commit

    car = read_car(body["blocks"])
    c = decode_commit(car.blocks[car.roots[0]])
    sig = bytearray(c.sig)
    sig[10] ^= 0x01
    return replace_commit(body, dataclasses.replace(c, sig=bytes(sig)))


def rewrite_car(body: dict[str, Any], *, roots: list[CID] | None = None, drop: set[CID] = frozenset(),
                corrupt: CID | None = None) -> dict[str, Any]:
    car = read_car(body["blocks"])
    out = bytearray()
    blocks = [(c, b) for c, b in car.blocks.items() if c not in drop]
    data = write_car(roots or car.roots, blocks)
    if corrupt is not None:
        block = car.blocks[corrupt]
        i = data.index(block)
        out = bytearray(data)
        out[i + len(block) - 1] ^= 0xFF
        data = bytes(out)
    return {**body, "blocks": data}
