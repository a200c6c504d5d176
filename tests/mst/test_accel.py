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


# --- DAG-CBOR helpers: strict CIDs, the value walk, commit blocks ------------------------------


def reference_decode(data: bytes) -> Outcome:
    """``cbor.decode`` as it is without the native path: cbrrr with the Python CID constructor,
    then the Python value walk."""
    def decode() -> object:
        obj, n = cbor._c.decode_dag_cbor(data, cbor._strict_cid, False)
        if n != len(data):
            raise cbor.CBORError("cbor_trailing_bytes", "")
        if type(obj) in (dict, list):
            cbor._check_values(obj)
        return obj
    try:
        return ("ok", decode())
    except cbor.CBORError as exc:
        return ("error", exc.reason)
    except Exception as exc:  # noqa: BLE001 - cbrrr's errors, classified as mst.cbor does
        return ("error", cbor._classify(exc))


def test_strict_cid_makes_blessed_links_and_hands_the_rest_to_the_reference(accel: ModuleType) -> None:
    from mst import native

    # mst.cbor really decodes through it (when the native path is on: not under RELAY_PURE_PYTHON)
    assert cbor._cid_ctor is (accel.strict_cid if native.ACCEL else cbor._strict_cid)
    accel.init_cbor(cbor._strict_cid)  # what mst.cbor does when the native path is on
    for prefix in (b"\x01\x71\x12\x20", b"\x01\x55\x12\x20"):
        raw = prefix + bytes(range(32))
        got = accel.strict_cid(raw)
        assert type(got) is CID and got == CID(raw) and got.cid_bytes is raw and hash(got) == hash(CID(raw))
    for bad in (b"\x01\x70\x12\x20" + bytes(32), b"\x01\x71\x13\x20" + bytes(32), b"\x01\x71\x12\x20" + bytes(31),
                b"\x01\x71\x12\x20" + bytes(33), b"", b"\x01\x55\x12\x21" + bytes(32)):
        with pytest.raises(cbor._BadCID):
            accel.strict_cid(bad)


def test_values_walk_accepts_exactly_what_the_reference_accepts(accel: ModuleType) -> None:
    def nested(depth: int, leaf: object) -> object:
        obj: object = leaf
        for level in range(depth):
            obj = [obj] if level % 2 else {"k": obj}
        return obj

    cases: list[object] = [
        {}, [], {"a": 1, "b": [1, 2, {"c": None}]}, [True, False, 1.5, "x", b"y", None],
        [2**63 - 1, -(2**63)], [2**63], [-(2**63) - 1], {"a": {"b": [2**64]}}, {"a": [{"b": -(2**70)}]},
        nested(255, 1), nested(256, 1), nested(256, [1]), nested(257, 1), nested(255, 2**63),
    ]
    for obj in cases:
        try:
            cbor._check_values(obj)
            want = True
        except cbor.CBORError:
            want = False
        assert accel.values_ok(obj) is want, obj if not isinstance(obj, dict | list) or len(str(obj)) < 200 else "deep"
    assert accel.values_ok(1) is False and accel.values_ok("x") is False


@pytest.mark.parametrize("seed", range(3))
def test_strict_decoding_matches_the_reference(accel: ModuleType, seed: int) -> None:
    """``cbor.decode`` (native CID constructor and value walk) against the pure-Python decoding,
    on valid values and mutations of them: same values, same error reasons."""
    rng = random.Random(seed)
    link = cid_for_cbor(b"\xa0")
    raw_link = cid_for_raw(b"x")
    values: list[object] = [
        {"op": 1, "t": "#commit"},
        {"ops": [{"action": "create", "path": "a/b", "cid": link, "prev": None}], "blocks": b"\x00" * 40,
         "seq": 2**62, "n": -(2**63), "l": [raw_link, link, [link]]},
        [link, {"x": [1, 2, 3]}, "text", 1.25],
    ]
    seen_ok = seen_error = 0
    for _ in range(400):
        data = cbor.encode(rng.choice(values))
        if rng.random() < 0.8:
            data = mutate(rng, data)
        want = reference_decode(data)
        try:
            got: Outcome = ("ok", cbor.decode(data))
        except cbor.CBORError as exc:
            got = ("error", exc.reason)
        assert got == want, data.hex()
        if got[0] == "ok":
            seen_ok += 1
        else:
            seen_error += 1
    assert seen_ok > 50 and seen_error > 50


def raw_commit(fields: list[tuple[str, bytes]], count: int | None = None) -> bytes:
    """A commit block written field by field (``fields``: key and its already encoded value), so
    key order, head sizes and the entry count can be made wrong on purpose."""
    out = bytearray([0xa0 + (len(fields) if count is None else count)])
    for key, value in fields:
        out += cbor.encode(key) + value
    return bytes(out)


def commit_fields(did: str = "did:plc:abcdefghijklmnopqrstuvwx", rev: str = "3kabcdefghij2",
                  sig: bytes = b"s" * 64, prev: CID | None = None, version: int = 3) -> list[tuple[str, bytes]]:
    data = cid_for_cbor(b"\x80")
    return [("did", cbor.encode(did)), ("rev", cbor.encode(rev)), ("sig", cbor.encode(sig)),
            ("data", cbor.encode(data)), ("prev", cbor.encode(prev)), ("version", cbor.encode(version))]


def check_commit(accel: ModuleType, block: bytes, *, must_handle: bool = False) -> Outcome:
    """The native commit decoder agrees with the reference; returns the reference's outcome."""
    from mst.commit import decode_commit, decode_commit_reference

    want = outcome(decode_commit_reference, block)
    raw = accel.commit(block)
    if want[0] == "error":
        assert raw is None, (want, raw)
    elif raw is not None:
        commit = want[1]
        assert raw == (commit.did, commit.version, commit.data, commit.rev, commit.prev, commit.sig,
                       cbor.encode_trusted(commit.unsigned_dict()))
        assert all(type(v) is t for v, t in zip(raw, (str, int, CID, str), strict=False))
        from mst.native import ACCEL

        native = decode_commit(block)
        assert native.signed == (raw[6] if ACCEL else None)
        assert native.unsigned_bytes() == commit.unsigned_bytes()
    else:
        assert not must_handle, "the native path declined a valid canonical commit"
    assert outcome(decode_commit, block) == want
    return want


def test_commit_blocks(accel: ModuleType) -> None:
    link = cid_for_cbor(b"\xa1")
    valid = [
        commit_fields(), commit_fields(prev=link), commit_fields(sig=b""), commit_fields(sig=b"x" * 300),
        commit_fields(did="did:web:example.com"), commit_fields(did="did:web:localhost%3A2583"),
        commit_fields(did="did:a:b"), commit_fields(did="did:plc:" + "a" * 2040),
        commit_fields(did="did:x:A.b_c-d:e%20f"), commit_fields(rev="2222222222222"),
        commit_fields(rev="jzzzzzzzzzzzz"),
    ]
    for fields in valid:
        assert check_commit(accel, raw_commit(fields), must_handle=True)[0] == "ok"
    invalid = [
        commit_fields(did="did:plc:abc:"), commit_fields(did="did:plc:abc%"), commit_fields(did="did:PLC:abc"),
        commit_fields(did="did::abc"), commit_fields(did="did:plc:"), commit_fields(did="did:plc"),
        commit_fields(did="dad:plc:abc"), commit_fields(did="did:plc:a/b"), commit_fields(did="did:plc:é"),
        commit_fields(did="did:plc:" + "a" * 2041), commit_fields(rev="kzzzzzzzzzzzz"),
        commit_fields(rev="3kabcdefghij"), commit_fields(rev="3kabcdefghij22"), commit_fields(rev="3kabcdefghij1"),
        commit_fields(rev="3kabcdefghijA"), commit_fields(version=2), commit_fields(prev=cid_for_raw(b"x")),
    ]
    for fields in invalid:
        assert check_commit(accel, raw_commit(fields))[0] == "error", fields
    base = commit_fields()
    structural = [
        raw_commit(base[:5]), raw_commit(base, count=7), raw_commit([base[1], base[0], *base[2:]]),
        raw_commit([*base[:3], base[4], base[3], base[5]]), raw_commit([*base, ("x", b"\x01")]),
        raw_commit([*base[:2], ("sig", cbor.encode("text")), *base[3:]]),
        raw_commit([*base[:3], ("data", cbor.encode(cid_for_raw(b"y"))), *base[4:]]),
        raw_commit([*base[:3], ("data", b"\xf6"), *base[4:]]),
        raw_commit([("did", b"\x78\x0b" + b"did:plc:abc"), *base[1:]]),  # non-minimal head
        raw_commit([*base[:5], ("version", b"\x18\x03")]),
        raw_commit(base) + b"\x00", raw_commit(base)[:-1], b"", b"\xa6", b"\x80",
    ]
    for block in structural:
        assert check_commit(accel, block)[0] == "error", block.hex()
    rng = random.Random(7)
    blocks = [raw_commit(f) for f in valid]
    for _ in range(2000):
        check_commit(accel, mutate(rng, rng.choice(blocks)))


@pytest.mark.parametrize("seed", range(2))
def test_invert_names_the_blocks_it_read(accel: ModuleType, seed: int) -> None:
    """``invert(..., seen)`` adds the blocks it read to ``seen`` when it accepts (what a reading
    ``firehose.prune.Recording`` records of the reference, which ``prune_slice`` relies on), and
    leaves ``seen`` alone when it declines."""
    from firehose.prune import Recording

    for blocks, after, ops, before in random_commits(seed, 40):
        seen: set[CID] = set()
        assert accel.invert(blocks, after, ops, seen) == before
        recording = Recording(blocks)
        assert ref_invert.invert_ops(recording, after, ops) == before
        assert seen == recording.seen and (seen or not ops)
        assert all(type(c) is CID for c in seen)
        wrong = [RepoOp("create", ops[0].path, cid_for_raw(b"other"))] if ops else []
        untouched: set[CID] = set()
        if wrong and accel.invert(blocks, after, wrong, untouched) is None:
            assert untouched == set()
    with pytest.raises(TypeError):
        accel.invert({}, cid_for_cbor(b"\xa0"), [], [])
