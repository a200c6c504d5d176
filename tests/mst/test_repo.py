"""Commits, the producer (Repo), full-repo verification and the real signed commits of
indigo-relay-scenarios/post_lifecycle.json."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import pytest

from mst import cbor
from mst.car import read_car, write_car
from mst.cid import parse_cid
from mst.commit import Commit, decode_commit, sign_commit, verify_commit_sig
from mst.crypto import PrivateKey, parse_multibase_key
from mst.errors import CommitError, MissingBlockError, RepoError
from mst.invert import invert_ops
from mst.ops import RepoOp
from mst.repo import Repo, Write
from mst.tid import TidClock
from mst.verify import verify_repo_car
from tests.mst.conftest import load_json

DID = "did:plc:ewvi7nxzyoun6zhxrhs64oiz"


def _b64(s: str) -> bytes:
    return base64.b64decode(s + "=" * (-len(s) % 4))


def _link(v: dict | None):
    return None if v is None else parse_cid(v["$link"])


def test_post_lifecycle_commits(fixtures_dir: Path) -> None:
    scenario = load_json(fixtures_dir / "indigo-relay-scenarios" / "post_lifecycle.json")
    account = scenario["accounts"][0]
    key_info = account["identity"]["keys"]["atproto"]
    key = parse_multibase_key(key_info["type"], key_info["publicKeyMultibase"])
    checked = 0
    for msg in scenario["messages"]:
        body = msg["frame"]["body"]
        car = read_car(_b64(body["blocks"]["$bytes"]))
        commit_cid = parse_cid(body["commit"]["$link"])
        assert car.roots[0] == commit_cid
        commit = decode_commit(car.blocks[commit_cid])
        assert commit.did == body["repo"] == account["identity"]["did"]
        assert commit.rev == body["rev"]
        assert verify_commit_sig(commit, key)
        assert commit.encode() == car.blocks[commit_cid]  # canonical re-encoding
        ops = [RepoOp(o["action"], o["path"], _link(o.get("cid")), _link(o.get("prev"))) for o in body["ops"]]
        assert invert_ops(car.blocks, commit.data, ops) == parse_cid(body["prevData"]["$link"])
        # a tampered signature fails
        forged = Commit(commit.did, 3, commit.data, commit.rev, None, commit.sig[:-1] + b"\x00")
        assert not verify_commit_sig(forged, key)
        checked += 1
    assert checked == len(scenario["messages"]) == 6


def test_commit_codec_and_errors() -> None:
    key = PrivateKey.generate_p256()
    data = parse_cid("bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm")
    commit, block, cid = sign_commit(DID, data, "3lmxjza3nva27", None, key)
    assert decode_commit(block) == commit
    assert verify_commit_sig(commit, key.did_key())
    assert not verify_commit_sig(commit, PrivateKey.generate_p256().public_key)
    good = cbor.decode(block)
    mutations = {
        "commit_schema": [{k: v for k, v in good.items() if k != "prev"}, {**good, "x": 1}, [1]],
        "commit_version": [{**good, "version": 2}, {**good, "version": "3"}],
        "commit_invalid_did": [{**good, "did": "did:PLC:x"}],
        "commit_invalid_rev": [{**good, "rev": "notatid"}],
        "commit_invalid_link": [
            {**good, "data": parse_cid("bafkreiccldh766hwcnuxnf2wh6jgzepf2nlu2lvcllt63eww5p6chi4ity")}
        ],
    }
    for reason, objs in mutations.items():
        for obj in objs:
            with pytest.raises(CommitError) as info:
                decode_commit(cbor.encode(obj))
            assert info.value.reason == reason
    with pytest.raises(CommitError) as info:
        decode_commit(block + b"\x00")
    assert info.value.reason == "commit_invalid_cbor"


def _random_writes(repo: Repo, rng: random.Random, n: int) -> list[Write]:
    writes: list[Write] = []
    paths = list(repo.records())
    rng.shuffle(paths)
    for _ in range(n):
        roll = rng.random()
        if roll < 0.5 or not paths:
            writes.append(Write("create", "app.bsky.feed.post", repo.clock.next(), {"t": rng.random().hex()}))
        elif roll < 0.75:
            coll, rkey = paths.pop().split("/")
            writes.append(Write("update", coll, rkey, {"u": rng.randrange(1 << 30)}))
        else:
            coll, rkey = paths.pop().split("/")
            writes.append(Write("delete", coll, rkey))
    return writes


@pytest.mark.parametrize("curve", ["k256", "p256"])
def test_producer_slices_invert_and_export_verifies(curve: str) -> None:
    key = PrivateKey.generate_k256() if curve == "k256" else PrivateKey.generate_p256()
    repo = Repo.create(DID, key, TidClock(clock_id=1))
    assert repo.genesis is not None and repo.genesis.ops == [] and repo.genesis.since is None
    rng = random.Random(42)
    for _ in range(150):
        before_rev, before_data = repo.rev, repo.data_root
        res = repo.apply_writes(_random_writes(repo, rng, rng.randint(1, 4)))
        assert res.since == before_rev and res.prev_data == before_data and res.rev > before_rev
        car = read_car(res.car)
        assert car.roots == [res.commit_cid]
        commit = decode_commit(car.blocks[res.commit_cid])
        assert commit == res.commit and commit.data == res.data == repo.data_root
        assert verify_commit_sig(commit, key.public_key)
        assert invert_ops(car.blocks, commit.data, res.ops) == before_data
        for op in res.ops:  # created/updated records are in the slice, deleted ones are not
            if op.cid is not None:
                assert op.cid in car.blocks
    exported = verify_repo_car(repo.export_car(), DID, key.did_key())
    assert exported.records == repo.records()
    assert exported.commit_cid == repo.head
    first = read_car(repo.export_car()).blocks
    assert list(first)[0] == repo.head  # commit block first


def test_repo_write_errors_leave_repo_unchanged() -> None:
    repo = Repo.create(DID, PrivateKey.generate_k256())
    repo.apply_writes([Write("create", "app.bsky.feed.post", "a", {"x": 1})])
    head = repo.head
    bad = [
        ([Write("create", "app.bsky.feed.post", "a", {"x": 2})], "write_record_exists"),
        ([Write("update", "app.bsky.feed.post", "b", {"x": 2})], "write_record_missing"),
        ([Write("delete", "app.bsky.feed.post", "b")], "write_record_missing"),
        ([Write("create", "not-an-nsid", "a", {"x": 2})], "write_invalid_path"),
        ([Write("create", "app.bsky.feed.post", "c", None)], "write_missing_record"),
        (
            [Write("create", "app.bsky.feed.post", "d", {}), Write("delete", "app.bsky.feed.post", "d")],
            "write_duplicate_path",
        ),
    ]
    for writes, reason in bad:
        with pytest.raises(RepoError) as info:
            repo.apply_writes(writes)
        assert info.value.reason == reason
    assert repo.head == head and len(repo) == 1
    assert repo.get_record("app.bsky.feed.post/a") == {"x": 1}


def test_verify_repo_car_failures() -> None:
    key = PrivateKey.generate_k256()
    repo = Repo.create(DID, key)
    repo.apply_writes([Write("create", "app.bsky.feed.post", str(i), {"i": i}) for i in range(40)])
    car = read_car(repo.export_car())
    with pytest.raises(CommitError) as info:
        verify_repo_car(repo.export_car(), "did:plc:someoneelse", key.did_key())
    assert info.value.reason == "commit_did_mismatch"
    with pytest.raises(CommitError) as info:
        verify_repo_car(repo.export_car(), DID, PrivateKey.generate_k256().did_key())
    assert info.value.reason == "commit_bad_signature"
    # drop one record block / one MST node
    records = set(repo.records().values())
    for victim in (next(iter(records)), next(c for c in car.blocks if c not in records and c != repo.head)):
        blocks = [(c, b) for c, b in car.blocks.items() if c != victim]
        with pytest.raises(MissingBlockError) as info2:
            verify_repo_car(write_car(car.roots, blocks), DID, key.did_key())
        assert info2.value.cid == victim
    # no commit block
    blocks = [(c, b) for c, b in car.blocks.items() if c != repo.head]
    with pytest.raises(CommitError) as info:
        verify_repo_car(write_car(car.roots, blocks), DID, None)
    assert info.value.reason == "commit_missing"


def test_resign_and_sign_with() -> None:
    key = PrivateKey.generate_k256()
    repo = Repo.create(DID, key)
    repo.apply_writes([Write("create", "app.bsky.feed.post", "a", {"x": 1})])
    data = repo.data_root
    res = repo.resign()
    assert res.ops == [] and res.data == data == res.prev_data
    assert invert_ops(read_car(res.car).blocks, res.data, []) == data
    other = PrivateKey.generate_p256()
    bad = repo.apply_writes([Write("create", "app.bsky.feed.post", "b", {"x": 2})], sign_with=other)
    assert not verify_commit_sig(bad.commit, key.public_key)
    assert verify_commit_sig(bad.commit, other.public_key)
    assert repo.head == bad.commit_cid  # state still advances
    assert repo.genesis is not None and repo.genesis.data == MST_EMPTY


MST_EMPTY = parse_cid("bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm")
