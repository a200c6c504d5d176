"""The native verification path (``mst._accel``) against the pure-Python reference
(``mst/_car.py``, ``mst/_invert.py``), differentially: on the interop vectors, on randomized
repositories (many ops per commit, creates/updates/deletes, empty and tiny trees, keys of unusual
heights) and on corrupted inputs, the two must give identical verdicts and reasons.

The native functions return ``None`` for whatever they do not accept (then the reference decides),
so the checks are: whenever the reference accepts canonical input, the native path accepts it too
with the same result (it is really used: no silent decline); whenever the reference rejects, the
native path declines; and the public wrappers give the reference's outcome, error reason included.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mst import _car as ref_car
from mst import _invert as ref_invert
from mst import cbor
from mst.accel import accelerated_invert_ops, accelerated_read_car, module
from mst.cid import CID, cid_for_cbor, cid_for_raw, parse_cid
from mst.errors import RepoError
from mst.mst import MST, build, covering_blocks, key_height
from mst.ops import RepoOp
from mst.verify import tree_records
from tests.mst.conftest import load_json

Outcome = tuple[Any, ...]


@pytest.fixture(scope="module")
def accel() -> ModuleType:
    return module()  # built by `pip install -e .` (./run test requires it)


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
    try:
        return ("ok", fn(*args, **kwargs))
    except RepoError as exc:
        return ("error", type(exc).__name__, exc.reason)


def car_outcome(fn: Callable[..., Any], data: bytes, **limits: int) -> Outcome:
    got = outcome(fn, data, **limits)
    return got if got[0] != "ok" else ("ok", got[1].roots, got[1].blocks)


def check_invert(accel: ModuleType, blocks: dict[CID, bytes], root: CID, ops: list[RepoOp],
                 *, must_handle: bool = False) -> Outcome:
    """The native inversion agrees with the reference; returns the reference's outcome."""
    want = outcome(ref_invert.invert_ops, blocks, root, ops)
    raw = accel.invert(blocks, root, ops)
    if want[0] == "error":
        assert raw is None, (want, raw)
    elif raw is not None:
        assert raw == want[1] and type(raw) is CID
    else:
        assert not must_handle, "the native path declined a valid canonical inversion"
    assert outcome(accelerated_invert_ops(ref_invert.invert_ops, accel), blocks, root, ops) == want
    return want


def check_car(accel: ModuleType, data: bytes, *, must_handle: bool = False, **limits: int) -> Outcome:
    """The native CAR reader agrees with the reference; returns the reference's outcome."""
    want = car_outcome(ref_car.read_car, data, **limits)
    full = {"max_blocks": ref_car.DEFAULT_MAX_BLOCKS, "max_block_bytes": ref_car.DEFAULT_MAX_BLOCK_BYTES,
            "max_total_bytes": ref_car.DEFAULT_MAX_TOTAL_BYTES, **limits}
    raw = accel.read_car(data, full["max_blocks"], full["max_block_bytes"], full["max_total_bytes"])
    if want[0] == "error":
        assert raw is None, (want, raw)
    elif raw is not None:
        assert raw == (want[1], want[2])
        assert all(type(c) is CID for c in [*raw[0], *raw[1]])
    else:
        assert not must_handle, "the native path declined a valid canonical CAR"
    assert car_outcome(accelerated_read_car(ref_car, accel), data, **limits) == want
    return want


# --- interop vectors ------------------------------------------------------------------------


def test_commit_proof_vectors(accel: ModuleType, interop_dir: Path) -> None:
    cases = load_json(interop_dir / "firehose" / "commit-proof-fixtures.json")
    assert len(cases) >= 5
    for case in cases:
        leaf = parse_cid(case["leafValue"])
        store: dict[CID, bytes] = {}
        before = build(store, [(k, leaf) for k in case["keys"]])
        tree = MST.load(store, before)
        ops = []
        for k in case["adds"]:
            tree = tree.put(k, leaf)
            ops.append(RepoOp("create", k, leaf, None))
        for k in case["dels"]:
            tree = tree.delete(k)
            ops.append(RepoOp("delete", k, None, leaf))
        tree.persist()
        proof = {c: store[c] for c in map(parse_cid, case["blocksInProof"])}
        for perm in itertools.permutations(ops):
            assert check_invert(accel, proof, tree.root, list(perm), must_handle=True) == ("ok", before)
        # every block of the proof is needed: without one, both paths refuse alike
        for missing in proof:
            check_invert(accel, {c: b for c, b in proof.items() if c != missing}, tree.root, ops)


def test_key_height_vectors(accel: ModuleType, interop_dir: Path) -> None:
    for v in load_json(interop_dir / "mst" / "key_heights.json"):
        key = v["key"].encode()
        valid = ref_invert.checked_height(key) >= 0
        assert accel.checked_height(key) == (v["height"] if valid else -1), v


def test_data_model_vectors_as_node_and_car_blocks(accel: ModuleType, interop_dir: Path) -> None:
    """Every interop DAG-CBOR value (valid or not), as a tree's root node and as a CAR header."""
    import base64

    vectors = [v.get("cbor_base64") for v in load_json(interop_dir / "data-model" / "data-model-fixtures.json")]
    vectors += [v.get("cbor_base64") for v in load_json(interop_dir / "data-model" / "data-model-invalid.json")]
    blobs = [base64.b64decode(v + "=" * (-len(v) % 4)) for v in vectors if v]
    assert len(blobs) >= 3
    leaf = cid_for_raw(b"leaf")
    for blob in blobs:
        root = cid_for_cbor(blob)
        check_invert(accel, {root: blob}, root, [RepoOp("delete", "app.bsky.feed.post/x", None, leaf)])
        check_car(accel, bytes([len(blob)]) + blob if len(blob) < 128 else blob)


# --- randomized repositories ----------------------------------------------------------------

COLLECTIONS = ["app.bsky.feed.post", "app.bsky.feed.like", "app.bsky.graph.follow", "a.b.c"]
RKEY_CHARS = "abcdefghijklmnopqrstuvwxyz234567ABCXYZ0189_~:.-"


def random_key(rng: random.Random, height: int | None = None) -> str:
    """A random repo path; with ``height``, one of exactly that MST height (found by search)."""
    while True:
        key = f"{rng.choice(COLLECTIONS)}/{''.join(rng.choices(RKEY_CHARS, k=rng.randint(1, 20)))}"
        if height is None or key_height(key.encode()) == height:
            return key


def random_value(rng: random.Random) -> CID:
    return cid_for_cbor(cbor.encode({"v": rng.randbytes(8)})) if rng.random() < 0.8 else cid_for_raw(rng.randbytes(4))


def random_commits(seed: int, commits: int) -> list[tuple[dict[CID, bytes], CID, list[RepoOp], CID]]:
    """``(slice blocks, root after, ops, root before)`` of random commits on one growing tree."""
    rng = random.Random(seed)
    store: dict[CID, bytes] = {}
    tree = MST.empty(store)
    tree.persist()
    records: dict[str, CID] = {}
    out = []
    for _ in range(commits):
        before = tree.root
        ops: list[RepoOp] = []
        touched: set[str] = set()
        for _ in range(rng.choice([1, 1, 2, 3, 5, 20, 60])):
            roll = rng.random()
            if roll < 0.5 or not records:
                key = random_key(rng, rng.choice([None, None, None, 0, 1, 2, 3]))
                if key in records or key in touched:
                    continue
                cid = random_value(rng)
                tree = tree.put(key, cid)
                records[key] = cid
                ops.append(RepoOp("create", key, cid, None))
            else:
                key = rng.choice(sorted(records))
                if key in touched:
                    continue
                if roll < 0.75:
                    cid = random_value(rng)
                    tree = tree.put(key, cid)
                    ops.append(RepoOp("update", key, cid, records[key]))
                    records[key] = cid
                else:
                    tree = tree.delete(key)
                    ops.append(RepoOp("delete", key, None, records.pop(key)))
            touched.add(key)
        if rng.random() < 0.1:  # sometimes delete everything
            for key in sorted(records):
                if key not in touched:
                    tree = tree.delete(key)
                    ops.append(RepoOp("delete", key, None, records.pop(key)))
        tree.persist()
        after = tree.root
        out.append((covering_blocks(store, after, [op.path for op in ops]), after, ops, before))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_repositories(accel: ModuleType, seed: int) -> None:
    handled = 0
    for blocks, after, ops, before in random_commits(seed, 60):
        assert check_invert(accel, blocks, after, ops, must_handle=True) == ("ok", before)
        car = ref_car.write_car([after], blocks.items())
        check_car(accel, car, must_handle=True)
        handled += 1
    assert handled == 60


# --- corrupted inputs -------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    roll = rng.random()
    at = rng.randrange(len(b)) if b else 0
    if roll < 0.4 and b:
        b[at] ^= 1 << rng.randrange(8)
    elif roll < 0.55 and b:
        b[at] = rng.choice([0x00, 0x18, 0x19, 0x1a, 0x1b, 0x40, 0x58, 0x5f, 0x60, 0x61, 0x9f, 0xbf, 0xf6, 0xf7, 0xff])
    elif roll < 0.7:
        b.insert(at, rng.randrange(256))
    elif roll < 0.85 and b:
        del b[at]
    elif roll < 0.93:
        del b[at:]
    else:
        b += rng.randbytes(rng.randint(1, 3))
    return bytes(b)


def reencoded_variants(data: bytes) -> list[bytes]:
    """Structured edits of a node: keys out of order, prefix not maximal, p out of range, wrong
    field types, non-minimal lengths (made through the generic encoder where it can express them)."""
    node = cbor.decode(data)
    out = []
    entries = node["e"]
    if len(entries) >= 2:
        swapped = dict(node, e=[entries[1], entries[0], *entries[2:]])
        out.append(cbor.encode(swapped))
    if entries:
        e0 = entries[-1]
        for change in ({"p": e0["p"] + 1}, {"p": 0, "k": b"x" + e0["k"]}, {"k": b""},
                       {"t": e0["v"]}, {"v": None}, {"k": e0["k"].decode("latin-1")}):
            out.append(cbor.encode(dict(node, e=[*entries[:-1], dict(e0, **change)])))
        out.append(cbor.encode(dict(node, e=[*entries[:-1], {**e0, "x": 1}])))
    if len(entries) >= 2:  # two keys swapped (prefix compression recomputed): order broken
        keys, prev = [], b""
        for e in entries:
            prev = prev[: e["p"]] + e["k"]
            keys.append(prev)
        order = list(range(len(entries)))
        order[-2], order[-1] = order[-1], order[-2]
        swapped_entries, prev = [], b""
        for j in order:
            p = next((n for n in range(min(len(prev), len(keys[j]))) if prev[n] != keys[j][n]),
                     min(len(prev), len(keys[j])))
            swapped_entries.append(dict(entries[j], p=p, k=keys[j][p:]))
            prev = keys[j]
        out.append(cbor.encode(dict(node, e=swapped_entries)))
        last = entries[-1]
        if last["p"] > 0:  # prefix compression not maximal (same keys)
            shared = keys[-2][last["p"] - 1 : last["p"]]
            out.append(cbor.encode(dict(node, e=[*entries[:-1], dict(last, p=last["p"] - 1, k=shared + last["k"])])))
    out.append(cbor.encode(dict(node, x=1)))
    out.append(cbor.encode({"e": node["e"]}))
    return out


def child_links(data: bytes) -> list[CID]:
    node = cbor.decode(data)
    return [c for c in [node["l"], *(e["t"] for e in node["e"])] if c is not None]


def with_child(blocks: dict[CID, bytes], root: CID, old: CID, new: bytes) -> tuple[dict[CID, bytes], CID]:
    """The slice with the root's link to ``old`` pointing at the block ``new`` instead."""
    node = cbor.decode(blocks[root])
    new_cid = cid_for_cbor(new)
    node["l"] = new_cid if node["l"] == old else node["l"]
    node["e"] = [dict(e, t=new_cid) if e["t"] == old else e for e in node["e"]]
    data = cbor.encode(node)
    return {**blocks, new_cid: new, cid_for_cbor(data): data}, cid_for_cbor(data)


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_slices_nodes_and_ops(accel: ModuleType, seed: int) -> None:
    rng = random.Random(1000 + seed)
    verdicts: set[Outcome] = set()
    for blocks, after, ops, _before in random_commits(seed, 40):
        # a corrupted node (re-hashed, so it is reached): the root, or any node under a fixed parent
        data = blocks.get(after)
        if data is not None:
            pointer_root = cbor.encode({"e": [], "l": after})
            for bad in [mutate(rng, data) for _ in range(8)] + reencoded_variants(data) + [pointer_root]:
                root = cid_for_cbor(bad)
                got = check_invert(accel, {**blocks, root: bad}, root, ops)
                verdicts.add(got[:1] if got[0] == "ok" else got)
            # a corrupted child of the root; a node of another layer, or an empty node, as its child
            for old in [c for c in child_links(data) if c in blocks][:2]:
                grandchildren = [blocks[c] for c in child_links(blocks[old]) if c in blocks]
                empty = cbor.encode({"e": [], "l": None})
                pointer = cbor.encode({"e": [], "l": old})
                for bad in [mutate(rng, blocks[old]) for _ in range(4)] + reencoded_variants(blocks[old]) + [
                        empty, pointer, data, *grandchildren[:1]]:
                    got = check_invert(accel, *with_child(blocks, after, old, bad), ops)
                    verdicts.add(got[:1] if got[0] == "ok" else got)
        # a block missing from the slice
        if blocks:
            gone = rng.choice(sorted(blocks, key=lambda c: c.cid_bytes))
            check_invert(accel, {c: b for c, b in blocks.items() if c != gone}, after, ops)
        if not ops:
            continue
        # ops edited: wrong value, no prev, bad path or action, an op dropped, order changed
        edited = [list(ops) for _ in range(7)]
        i = rng.randrange(len(ops))
        op = ops[i]
        edited[0][i] = RepoOp(op.action, op.path, random_value(rng), op.prev)
        edited[1][i] = RepoOp(op.action, op.path, op.cid, None)
        edited[2][i] = RepoOp(op.action, rng.choice(["bad", "a/b/c", "/x", "x/", "é/x", "a/" + "x" * 1100]), op.cid, op.prev)
        edited[3][i] = RepoOp(rng.choice(["create", "update", "delete", "upsert"]), op.path, op.cid, op.prev)  # type: ignore[arg-type]
        del edited[4][i]
        rng.shuffle(edited[5])
        edited[6][i] = RepoOp(op.action, op.path, op.cid, CID(b"\x12\x20" + bytes(32)) if op.prev else None)
        for variant in edited:
            got = check_invert(accel, blocks, after, variant)
            verdicts.add(got[:1] if got[0] == "ok" else got)
        # the CAR: random damage, and limits
        car = ref_car.write_car([after], blocks.items())
        for _ in range(6):
            got = check_car(accel, mutate(rng, car))
            verdicts.add(got[:1] if got[0] == "ok" else got)
        check_car(accel, car, max_blocks=max(len(blocks) - 1, 0))
        check_car(accel, car, max_block_bytes=max(len(b) for b in blocks.values()) - 1)
        check_car(accel, car, max_total_bytes=len(car) - 1)
    # the corruptions reached many distinct reasons (so the comparison was not vacuous)
    assert len({v for v in verdicts if v[0] == "error"}) >= 10, verdicts


# --- whole-tree walks (full repository verification) -----------------------------------------


def check_records(accel: ModuleType, blocks: dict[CID, bytes], root: CID, require: bool,
                  *, must_handle: bool = False) -> Outcome:
    """The native walk agrees with the reference ``tree_records``; returns its outcome."""
    want = outcome(tree_records, blocks, root, require)
    raw = accel.records(blocks, root, require)
    if want[0] == "error":
        assert raw is None, (want, raw)
    elif raw is not None:
        assert list(raw.items()) == list(want[1].items())
        assert all(type(c) is CID for c in raw.values())
    else:
        assert not must_handle, "the native path declined a valid tree"
    return want


@pytest.mark.parametrize("seed", range(3))
def test_whole_tree_walks(accel: ModuleType, seed: int) -> None:
    rng = random.Random(2000 + seed)
    verdicts: set[Outcome] = set()
    for size in (0, 1, 2, 17, 300, 3000):
        records = {random_key(rng, rng.choice([None, None, 0, 1, 2])): random_value(rng) for _ in range(size)}
        store: dict[CID, bytes] = {}
        root = build(store, records.items())
        leaves = {c: b"\xa0" for c in records.values()}
        full = {**store, **leaves}
        assert check_records(accel, full, root, True, must_handle=True) == ("ok", dict(sorted(records.items())))
        check_records(accel, store, root, False, must_handle=True)
        got = check_records(accel, store, root, True)  # record blocks absent
        verdicts.add(got[:1] if got[0] == "ok" else got)
        # a node missing, corrupted, or two subtrees swapped (keys out of order across nodes)
        nodes = sorted(store, key=lambda c: c.cid_bytes)
        for _ in range(4 if len(nodes) > 1 else 0):
            gone = rng.choice(nodes)
            got = check_records(accel, {c: b for c, b in full.items() if c != gone}, root, True)
            verdicts.add(got[:1] if got[0] == "ok" else got)
        links = child_links(store[root])
        for old in links[:2]:
            for bad in [mutate(rng, store[old]) for _ in range(4)] + reencoded_variants(store[old]):
                got = check_records(accel, *with_child(full, root, old, bad), True)
                verdicts.add(got[:1] if got[0] == "ok" else got)
        if len(links) >= 2:
            node = cbor.decode(store[root])
            swapped = [c if c not in links[:2] else links[1 - links.index(c)] for c in [node["l"], *(e["t"] for e in node["e"])]]
            node["l"] = swapped[0]
            node["e"] = [dict(e, t=t) for e, t in zip(node["e"], swapped[1:], strict=True)]
            data = cbor.encode(node)
            got = check_records(accel, {**full, cid_for_cbor(data): data}, cid_for_cbor(data), True)
            verdicts.add(got[:1] if got[0] == "ok" else got)
    assert ("error", "MSTError", "mst_key_order") in verdicts
    assert len({v for v in verdicts if v[0] == "error"}) >= 4, verdicts


def test_block_hashes_at_every_padding_boundary(accel: ModuleType) -> None:
    """Blocks of every length around SHA-256's 64-byte block and padding boundaries, right and
    wrong, through both CAR readers."""
    rng = random.Random(5)
    lengths = [*range(0, 200), 447, 448, 511, 512, 767, 768, 769, 4095, 4096, 65_537]
    blocks = [(cid_for_raw(data), data) for data in (rng.randbytes(n) for n in lengths)]
    car = ref_car.write_car([cid_for_cbor(b"\xa0")], blocks)
    assert check_car(accel, car, must_handle=True)[0] == "ok"
    for cid, data in blocks[::7]:
        bad = data[:-1] + bytes([data[-1] ^ 1]) if data else b"\x00"
        assert check_car(accel, ref_car.write_car([cid], [(cid, bad)]))[2] == "car_hash_mismatch"
