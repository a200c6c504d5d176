"""MST behaviour: node codec validation, partial trees, typed inversion failures, diff."""

from __future__ import annotations

import pytest

from mst import cbor
from mst._node import _encode_node_generic  # the generic encoder, compared with the fast path
from mst.cid import CID, cid_for_cbor, cid_for_raw
from mst.errors import InversionError, MissingBlockError, MSTError
from mst.invert import invert_ops
from mst.mst import MST, build, covering_blocks, mst_diff
from mst.node import (
    common_prefix_len,
    decode_node,
    encode_node,
    iter_new_nodes,
    key_height,
    sub_cid,
)
from mst.ops import RepoOp

LEAF = cid_for_cbor(cbor.encode({"v": 1}))
LEAF2 = cid_for_cbor(cbor.encode({"v": 2}))


def _keys(n: int) -> list[str]:
    return [f"com.example.record/{i:08d}" for i in range(n)]


def _tree(n: int) -> tuple[dict, MST]:
    store: dict = {}
    root = build(store, [(k, LEAF) for k in _keys(n)])
    return store, MST.load(store, root)


def test_put_get_update_delete() -> None:
    tree = MST.empty({})
    t1 = tree.put("com.example.a/1", LEAF)
    assert t1.get("com.example.a/1") == LEAF
    assert tree.get("com.example.a/1") is None  # persistence: old tree unchanged
    t2 = t1.put("com.example.a/1", LEAF2)
    assert t2.get("com.example.a/1") == LEAF2 and t2.root != t1.root
    assert t1.put("com.example.a/1", LEAF).root == t1.root
    assert t2.delete("com.example.a/1").root == tree.root
    with pytest.raises(MSTError) as info:
        t2.delete("com.example.a/2")
    assert info.value.reason == "mst_key_not_found"


@pytest.mark.parametrize("bad", ["", "noslash", "a/b/c", "/x", "x/", "a/b c", "a/" + "x" * 1100])
def test_invalid_keys_rejected(bad: str) -> None:
    with pytest.raises(MSTError) as info:
        MST.empty({}).put(bad, LEAF)
    assert info.value.reason == "mst_key_invalid"


def test_large_tree_roundtrip_and_diff() -> None:
    store, tree = _tree(1500)
    assert sum(1 for _ in tree.items()) == 1500
    t2 = tree.put("com.example.record/00000007", LEAF2).delete("com.example.record/00000008")
    t2 = t2.put("com.example.other/x", LEAF)
    t2.persist(store)
    ops = mst_diff(store, tree.root, t2.root)
    assert ops == [
        RepoOp("create", "com.example.other/x", LEAF, None),
        RepoOp("update", "com.example.record/00000007", LEAF2, LEAF),
        RepoOp("delete", "com.example.record/00000008", None, LEAF),
    ]
    assert mst_diff(store, tree.root, tree.root) == []


def test_partial_tree_missing_block_is_typed() -> None:
    store, tree = _tree(800)
    root_block = {tree.root: store[tree.root]}
    partial = MST.load(root_block, tree.root)
    key = "com.example.record/00000400"
    if tree.layer > 0 and partial.node.keys and key.encode() not in partial.node.keys:
        with pytest.raises(MissingBlockError) as info:
            partial.get(key)
        assert info.value.reason == "missing_block"
    # an inversion needing more than the root block fails with the missing CID, never guesses
    op = RepoOp("create", key, LEAF, None)
    with pytest.raises(MissingBlockError) as info2:
        invert_ops(root_block, tree.root, [op])
    assert info2.value.cid in store


def test_inversion_errors_are_typed() -> None:
    store, tree = _tree(50)
    root = tree.root
    k = "com.example.record/00000010"
    cases = [
        (RepoOp("create", "com.example.record/zzz", LEAF, None), "inversion_create_absent"),
        (RepoOp("create", k, LEAF2, None), "inversion_value_mismatch"),
        (RepoOp("update", k, LEAF, None), "inversion_missing_prev"),
        (RepoOp("update", "com.example.record/zzz", LEAF, LEAF2), "inversion_update_absent"),
        (RepoOp("delete", k, None, LEAF), "inversion_delete_present"),
        (RepoOp("delete", "com.example.record/zzz", None, None), "inversion_missing_prev"),
        (RepoOp("frobnicate", k, LEAF, None), "inversion_bad_op"),  # type: ignore[arg-type]
        (RepoOp("create", "not a path", LEAF, None), "inversion_bad_op"),
    ]
    for op, reason in cases:
        with pytest.raises(InversionError) as info:
            invert_ops(store, root, [op])
        assert info.value.reason == reason, op


def test_covering_blocks_invert_every_single_op() -> None:
    store, tree = _tree(600)
    for i in range(0, 600, 37):
        path = f"com.example.record/{i:08d}"
        after = tree.delete(path)
        after.persist(store)
        proof = covering_blocks(store, after.root, [path])
        proof.update(dict(after.new_blocks()))
        assert invert_ops(proof, after.root, [RepoOp("delete", path, None, LEAF)]) == tree.root
        after2 = tree.put(path + "x", LEAF2)
        after2.persist(store)
        proof2 = covering_blocks(store, after2.root, [path + "x"])
        assert invert_ops(proof2, after2.root, [RepoOp("create", path + "x", LEAF2)]) == tree.root


def _node_bytes(entries: list[dict], left: object = None) -> bytes:
    return cbor.encode({"e": entries, "l": left})


def _key_of_height(h: int, prefix: str = "com.example.k/") -> bytes:
    i = 0
    while True:
        k = f"{prefix}{i}".encode()
        if key_height(k) == h:
            return k
        i += 1


def _compressed(keys: list[bytes]) -> list[dict]:
    out, prev = [], b""
    for k in keys:
        p = common_prefix_len(prev, k)
        out.append({"k": k[p:], "p": p, "t": None, "v": LEAF})
        prev = k
    return out


def test_decode_node_rejects_non_canonical() -> None:
    k0 = _key_of_height(0)
    k0b = _key_of_height(0, "com.example.z/")
    k1 = _key_of_height(1, "com.example.m/")  # sorts between k0 and k0b
    sub = cid_for_cbor(b"\xa0")
    good = _node_bytes(_compressed([k0, k0b]))
    assert decode_node(good, None, None).keys == [k0, k0b]
    bad_cases = {
        "mst_node_invalid": [
            cbor.encode({"e": []}),
            cbor.encode({"e": [], "l": None, "x": 1}),
            _node_bytes([{"k": k0, "p": 0, "v": LEAF}]),
            _node_bytes([{"k": "str", "p": 0, "t": None, "v": LEAF}]),
            _node_bytes([], left=cid_for_raw(b"x")),
            _node_bytes([{"k": k0, "p": 0, "t": CID(sub.cid_bytes + b"\x00"), "v": LEAF}]),
            _node_bytes([{"k": k0, "p": 0, "t": cid_for_raw(b"x"), "v": LEAF}]),
            _node_bytes([{"k": k0, "p": 0, "t": None, "v": CID(b"\x01\x70\x12\x20" + bytes(32))}]),
            b"\xff",
        ],
        "mst_prefix_invalid": [
            _node_bytes([{"k": k0, "p": 1, "t": None, "v": LEAF}]),
            _node_bytes([{"k": k0, "p": 0, "t": None, "v": LEAF}, {"k": k0b, "p": 0, "t": None, "v": LEAF}]),
        ],
        "mst_key_order": [_node_bytes(_compressed([k0b, k0]))],
        "mst_key_height": [
            _node_bytes([{"k": k0, "p": 0, "t": sub, "v": LEAF}]),  # layer 0 with a subtree
            _node_bytes(_compressed([k0, k1])),  # heights 0 and 1 in one node
        ],
        "mst_non_canonical": [_node_bytes([], left=sub)],
        "mst_key_invalid": [_node_bytes([{"k": b"nokey", "p": 0, "t": None, "v": LEAF}])],
    }
    for reason, blobs in bad_cases.items():
        for blob in blobs:
            with pytest.raises(MSTError) as info:
                decode_node(blob, None, None)
            assert info.value.reason == reason, (reason, blob.hex())
    # a root at the wrong layer, and an empty node (valid only as a root)
    with pytest.raises(MSTError) as info:
        decode_node(_node_bytes(_compressed([k1])), None, 0)
    assert info.value.reason == "mst_key_height"
    with pytest.raises(MSTError) as info:
        decode_node(_node_bytes([]), None, 0)
    assert info.value.reason == "mst_non_canonical"


def test_patched_encodings_equal_full_encodings() -> None:
    store, tree = _tree(2000)
    t2 = tree
    for i in range(0, 2000, 97):
        t2 = t2.put(f"com.example.record/{i:08d}", LEAF2)
    t2 = t2.delete("com.example.record/00000500").put("com.example.record/00000500x", LEAF)
    checked = 0
    for node in iter_new_nodes(t2.node):
        fast = node.encode()
        full = encode_node(node.keys, node.vals, [sub_cid(s) for s in node.subs])
        assert fast == full == _encode_node_generic(node.keys, node.vals, [sub_cid(s) for s in node.subs])
        checked += 1
    assert checked > 20
    # and a freshly built tree of the same content has the same root
    assert build({}, list(t2.items())) == t2.root


def test_checked_height_matches_key_height_and_validity() -> None:
    import random

    from mst.node import checked_height, is_valid_mst_key

    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789.-_~:"
    seen = set()
    for i in range(3000):
        key = f"com.example.t{i}/{''.join(rng.choices(alphabet, k=rng.randint(1, 40)))}".encode()
        h = checked_height(key)
        assert h == key_height(key)
        seen.add(h)
        assert checked_height(key) == h  # cached
    assert {0, 1, 2} <= seen
    for bad in (b"", b"noslash", b"a/b/c", b"a/b c", b"a/" + b"x" * 1100, "ü/x".encode()):
        assert not is_valid_mst_key(bad)
        assert checked_height(bad) == -1
