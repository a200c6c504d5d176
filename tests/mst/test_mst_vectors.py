"""MST against the interop vectors: key heights, common prefix, example keys, commit proofs."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from mst.cid import cid_for_cbor, parse_cid
from mst.invert import invert_ops
from mst.mst import MST, build, covering_blocks, key_height, mst_diff
from mst.node import common_prefix_len
from mst.ops import RepoOp
from tests.mst.conftest import load_json


def test_key_heights(interop_dir: Path) -> None:
    vectors = load_json(interop_dir / "mst" / "key_heights.json")
    assert vectors
    for v in vectors:
        assert key_height(v["key"].encode()) == v["height"], v


def test_common_prefix(interop_dir: Path) -> None:
    vectors = load_json(interop_dir / "mst" / "common_prefix.json")
    assert vectors
    for v in vectors:
        assert common_prefix_len(v["left"].encode(), v["right"].encode()) == v["len"], v


def test_example_keys_shape_independent_of_order(interop_dir: Path) -> None:
    keys = [k for k in (interop_dir / "mst" / "example_keys.txt").read_text().split("\n") if k]
    assert len(keys) > 100
    leaf = cid_for_cbor(b"\xa0")
    store: dict = {}
    root = build(store, [(k, leaf) for k in keys])
    shuffled = keys[:]
    random.Random(7).shuffle(shuffled)
    tree = MST.empty({})
    for k in shuffled:
        tree = tree.put(k, leaf)
    assert tree.root == root
    loaded = MST.load(store, root)
    assert [p for p, _ in loaded.items()] == sorted(keys)
    assert all(loaded.get(k) == leaf for k in keys)
    assert loaded.get("A0/000000") is None
    # deleting everything in another order returns to the empty tree
    for k in reversed(shuffled):
        tree = tree.delete(k)
    assert tree.root == MST.empty({}).root
    assert tree.root.encode() == "bafyreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm"


def _proof_cases(interop_dir: Path) -> list[dict]:
    return load_json(interop_dir / "firehose" / "commit-proof-fixtures.json")


def test_commit_proof_fixture_count(interop_dir: Path) -> None:
    assert len(_proof_cases(interop_dir)) >= 5


@pytest.mark.parametrize("index", range(5))
def test_commit_proof_vector(interop_dir: Path, index: int) -> None:
    case = _proof_cases(interop_dir)[index]
    leaf = parse_cid(case["leafValue"])
    store: dict = {}
    before = build(store, [(k, leaf) for k in case["keys"]])
    assert before.encode() == case["rootBeforeCommit"]

    tree = MST.load(store, before)
    ops: list[RepoOp] = []
    for k in case["adds"]:
        tree = tree.put(k, leaf)
        ops.append(RepoOp("create", k, leaf, None))
    for k in case["dels"]:
        tree = tree.delete(k)
        ops.append(RepoOp("delete", k, None, leaf))
    tree.persist()
    after = tree.root
    assert after.encode() == case["rootAfterCommit"]

    # our covering proof contains every block the reference implementation puts in the proof
    proof = covering_blocks(store, after, case["adds"] + case["dels"])
    wanted = {parse_cid(c) for c in case["blocksInProof"]}
    assert wanted <= set(proof)

    # inversion from the reference proof blocks alone, in every op order
    only_proof = {c: store[c] for c in wanted}
    for perm in itertools.permutations(ops):
        assert invert_ops(only_proof, after, list(perm)) == before
    # and from our own proof
    assert invert_ops(proof, after, ops) == before

    # diff in both directions
    diff = mst_diff(store, before, after)
    assert {(o.action, o.path) for o in diff} == {("create", k) for k in case["adds"]} | {
        ("delete", k) for k in case["dels"]
    }
