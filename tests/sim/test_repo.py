"""The simulator's repository producer: canonical MST, proofs, keys, commits that verify."""

from __future__ import annotations

import json
import random
import time
from bisect import bisect_left
from pathlib import Path

import pytest
from cbrrr import CID

from firehose.frames import encode_frame
from firehose.validate import validate_frame
from mst.crypto import parse_did_key
from mst.syntax import is_valid_did, is_valid_tid
from mst.verify import verify_repo_car
from sim.ident import SigningKey, TidClock, base58btc, plc_did
from sim.records import WriteMix
from sim.repo import MSTBuilder, SimRepo, Write, path_nodes


def _proof(root, keys: list[bytes], touched: list[str]) -> set[str]:
    seen: set[str] = set()
    for k in touched:
        kb = k.encode()
        i = bisect_left(keys, kb)
        probes = [kb] + ([keys[i - 1]] if i > 0 else [])
        j = i + 1 if i < len(keys) and keys[i] == kb else i
        probes += [keys[j]] if j < len(keys) else []
        for p in probes:
            seen |= {n.cid.encode() for n in path_nodes(root, p)}
    return seen


def test_mst_roots_and_proof_blocks_match_interop_vectors(fixtures_dir: Path) -> None:
    cases = json.loads((fixtures_dir / "interop/firehose/commit-proof-fixtures.json").read_text())
    assert cases
    for case in cases:
        leaf = CID.decode(case["leafValue"])
        builder = MSTBuilder()
        before = sorted(k.encode() for k in case["keys"])
        assert builder.build(before, [leaf] * len(before)).cid.encode() == case["rootBeforeCommit"]
        after = sorted((set(before) | {k.encode() for k in case["adds"]}) - {k.encode() for k in case["dels"]})
        root = builder.build(after, [leaf] * len(after))
        assert root.cid.encode() == case["rootAfterCommit"], case["comment"]
        assert _proof(root, after, case["adds"] + case["dels"]) == set(case["blocksInProof"]), case["comment"]


def test_did_keys_match_w3c_vectors(fixtures_dir: Path) -> None:
    k256 = json.loads((fixtures_dir / "interop/crypto/w3c_didkey_K256.json").read_text())
    for case in k256:
        assert SigningKey("k256", bytes.fromhex(case["privateKeyBytesHex"])).did_key() == case["publicDidKey"]
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    for case in json.loads((fixtures_dir / "interop/crypto/w3c_didkey_P256.json").read_text()):
        n = 0
        for ch in case["privateKeyBytesBase58"]:
            n = n * 58 + alphabet.index(ch)
        secret = n.to_bytes(32, "big")
        assert base58btc(secret) == case["privateKeyBytesBase58"]
        assert SigningKey("p256", secret).did_key() == case["publicDidKey"]


@pytest.mark.parametrize("curve", ["k256", "p256"])
def test_signatures_verify_and_are_low_s(curve: str) -> None:
    rng = random.Random(3)
    for i in range(20):
        key = SigningKey.generate(curve, rng)  # type: ignore[arg-type]
        msg = f"message {i}".encode()
        sig = key.sign(msg)
        assert len(sig) == 64
        assert parse_did_key(key.did_key()).verify(msg, sig)
        assert not parse_did_key(key.did_key()).verify(msg + b"x", sig)


def test_identifiers_are_valid_and_tids_increase() -> None:
    rng = random.Random(1)
    assert all(is_valid_did(plc_did(rng)) for _ in range(50))
    clock = TidClock(clock_id=5)
    tids = [clock.next() for _ in range(1000)]
    assert all(is_valid_tid(t) for t in tids)
    assert tids == sorted(tids) and len(set(tids)) == len(tids)


def _frame(repo_did: str, res, seq: int) -> bytes:
    body = {"seq": seq, "rebase": False, "tooBig": False, "repo": repo_did, "commit": res.commit_cid,
            "rev": res.rev, "since": res.since, "blocks": res.car, "ops": [o.to_wire() for o in res.ops],
            "blobs": [], "time": "2026-01-01T00:00:00.000Z"}
    if res.prev_data is not None:
        body["prevData"] = res.prev_data
    return encode_frame("#commit", body)


@pytest.mark.parametrize("curve", ["k256", "p256"])
def test_commit_chain_passes_relay_validation_and_export_verifies(curve: str) -> None:
    rng = random.Random(11)
    key = SigningKey.generate(curve, rng)  # type: ignore[arg-type]
    did = plc_did(rng)
    repo = SimRepo(did, key)
    mix = WriteMix(rng)
    state = None
    actions: set[str] = set()
    max_ops = 0
    for seq in range(1, 301):
        res = repo.apply_writes(mix.next_writes(repo.record_paths()))
        actions |= {o.action for o in res.ops}
        max_ops = max(max_ops, len(res.ops))
        verdict = validate_frame(_frame(did, res, seq), state, key.did_key(), time.time())
        assert verdict.kind == "accept", (seq, verdict)
        state = verdict.new_state
    assert actions == {"create", "update", "delete"} and max_ops > 1
    verified = verify_repo_car(repo.export_car(), did, key.did_key())
    assert verified.commit_cid == repo.head
    assert verified.records == repo.records()
    assert state is not None and state.data_cid == repo.data_root.encode()


def test_snapshot_restore_discards_a_fork() -> None:
    rng = random.Random(2)
    repo = SimRepo(plc_did(rng), SigningKey.generate("k256", rng))
    repo.apply_writes([Write("create", "app.bsky.feed.like", "3aaaaaaaaaaa2", {"a": 1})])
    head, data = repo.head, repo.data_root
    snap = repo.snapshot()
    repo.apply_writes([Write("create", "app.bsky.feed.like", "3aaaaaaaaaaa3", {"a": 2})])
    repo.restore(snap)
    assert (repo.head, repo.data_root) == (head, data)
    with pytest.raises(ValueError):
        repo.apply_writes([Write("delete", "app.bsky.feed.like", "3aaaaaaaaaaa3")])


def test_write_mix_is_realistic() -> None:
    rng = random.Random(4)
    mix = WriteMix(rng)
    repo = SimRepo(plc_did(rng), SigningKey.generate("k256", rng))
    single_creates = 0
    sizes: list[int] = []
    commits = 2000
    for _ in range(commits):
        res = repo.apply_writes(mix.next_writes(repo.record_paths()))
        if len(res.ops) == 1 and res.ops[0].action == "create":
            single_creates += 1
        sizes.append(len(res.car))
    assert single_creates > commits * 0.7
    assert min(sizes) < 2_000 and max(sizes) > 10_000


def test_mst_memo_gives_the_roots_of_fresh_builds_and_stays_small() -> None:
    """The node memo shared across versions never changes a root (a fresh builder agrees on every
    version, also when only a value changes) and holds about one tree's worth of small entries."""
    rng = random.Random(11)
    builder = MSTBuilder()
    tree: dict[bytes, CID] = {}
    for i in range(400):
        key = f"app.bsky.feed.post/{rng.randrange(600):06d}".encode()
        if key in tree and rng.random() < 0.3:
            del tree[key]
        else:
            tree[key] = CID.cidv1_dag_cbor_sha256_32_from(f"record {i}".encode())
        keys = sorted(tree)
        values = [tree[k] for k in keys]
        assert builder.build(keys, values).cid == MSTBuilder().build(keys, values).cid
        # cleared past n + 64 entries before a build, which adds at most one tree's nodes
        assert len(builder._memo) <= 2 * len(keys) + 128
        assert all(isinstance(memo_key[2], bytes) and len(memo_key[2]) <= 32 for memo_key in builder._memo)
