"""Property tests (hypothesis): tree shape independent of history, apply/invert, diff,
codec round trips against independent implementations, producer slices always invert."""

from __future__ import annotations

import random

import cbor2
import dag_cbor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mst import cbor
from mst.car import read_car, write_car
from mst.cid import cid_for_cbor
from mst.crypto import PrivateKey
from mst.invert import invert_ops
from mst.mst import MST, build, covering_blocks, mst_diff
from mst.ops import RepoOp
from mst.repo import Repo, Write
from mst.tid import TidClock

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

rkeys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz234567", min_size=1, max_size=14)
collections = st.sampled_from(["app.bsky.feed.post", "app.bsky.feed.like", "com.example.x"])
paths = st.builds(lambda c, r: f"{c}/{r}", collections, rkeys)
values = st.integers(min_value=0, max_value=5).map(lambda i: cid_for_cbor(cbor.encode({"v": i})))
entries = st.dictionaries(paths, values, max_size=120)

# DAG-CBOR data model values (no floats: atproto forbids them)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.text(max_size=20),
    st.binary(max_size=20),
    values,
)
data = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)


@SETTINGS
@given(entries, st.randoms(use_true_random=False))
def test_shape_independent_of_insertion_order(kv: dict, rnd: random.Random) -> None:
    store: dict = {}
    root = build(store, kv.items())
    items = list(kv.items())
    rnd.shuffle(items)
    tree = MST.empty({})
    for path, cid in items:
        tree = tree.put(path, cid)
    # add then remove some extra keys: history must not matter either
    extra = [f"com.example.zz/{i}" for i in range(rnd.randint(0, 8))]
    for p in extra:
        tree = tree.put(p, cid_for_cbor(b"\x01"))
    for p in extra:
        tree = tree.delete(p)
    assert tree.root == root
    assert list(MST.load(store, root).items()) == sorted(kv.items())


@SETTINGS
@given(entries, st.data())
def test_apply_then_invert_from_proof_returns_original_root(kv: dict, draw: st.DataObject) -> None:
    store: dict = {}
    before = build(store, kv.items())
    tree = MST.load(store, before)
    ops: list[RepoOp] = []
    existing = sorted(kv)
    touched: set[str] = set()
    for _ in range(draw.draw(st.integers(1, 6))):
        if existing and draw.draw(st.booleans()):
            path = draw.draw(st.sampled_from(existing))
            if path in touched:
                continue
            if draw.draw(st.booleans()):
                tree = tree.delete(path)
                ops.append(RepoOp("delete", path, None, kv[path]))
            else:
                new = cid_for_cbor(cbor.encode({"new": path}))
                tree = tree.put(path, new)
                ops.append(RepoOp("update", path, new, kv[path]))
        else:
            path = draw.draw(paths)
            if path in kv or path in touched:
                continue
            new = cid_for_cbor(cbor.encode({"c": path}))
            tree = tree.put(path, new)
            ops.append(RepoOp("create", path, new, None))
        touched.add(path)
    if not ops:
        return
    new_blocks = dict(tree.new_blocks())
    tree.persist(store)
    proof = covering_blocks(store, tree.root, [op.path for op in ops])
    proof.update(new_blocks)
    assert invert_ops(proof, tree.root, ops) == before
    # diff(before, after) applied to before gives after
    diff = mst_diff(store, before, tree.root)
    assert {o.path for o in diff} == touched
    again = MST.load(store, before)
    for op in diff:
        again = again.delete(op.path) if op.action == "delete" else again.put(op.path, op.cid)
    assert again.root == tree.root


@SETTINGS
@given(data)
def test_cbor_round_trip_matches_reference(value: object) -> None:
    encoded = cbor.encode(value)
    assert cbor.decode(encoded) == value
    # the pure-Python reference decodes it and re-encodes the very same bytes
    assert dag_cbor.encode(dag_cbor.decode(encoded)) == encoded


plain = st.recursive(  # values cbor2 can encode canonically without tags
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 63) - 1),
        st.text(max_size=12),
        st.binary(max_size=12),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)


@SETTINGS
@given(plain)
def test_encoding_matches_cbor2_canonical(value: object) -> None:
    # RFC 7049 canonical ordering (length first) is the DAG-CBOR map order
    assert cbor.encode(value) == cbor2.dumps(value, canonical=True)
    assert cbor.decode(cbor2.dumps(value, canonical=True)) == value


@SETTINGS
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_car_round_trip(blobs: list[bytes]) -> None:
    blocks = [(cid_for_cbor(cbor.encode(b)), cbor.encode(b)) for b in blobs]
    root = cid_for_cbor(cbor.encode("root"))
    car = read_car(write_car([root], blocks))
    assert car.roots == [root] and car.blocks == dict(blocks)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(5, 40))
def test_producer_slices_always_invert(seed: int, commits: int) -> None:
    rng = random.Random(seed)
    repo = Repo.create("did:plc:propertytestpropertytest", PrivateKey.generate_k256(), TidClock(1))
    for _ in range(commits):
        paths_now = list(repo.records())
        rng.shuffle(paths_now)
        writes: list[Write] = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if r < 0.55 or not paths_now:
                writes.append(
                    Write(
                        "create",
                        rng.choice(["app.bsky.feed.post", "a.b.c"]),
                        repo.clock.next(),
                        {"i": rng.randrange(1000)},
                    )
                )
            elif r < 0.8:
                writes.append(Write("update", *paths_now.pop().split("/"), {"u": 1}))
            else:
                writes.append(Write("delete", *paths_now.pop().split("/")))
        before = repo.data_root
        res = repo.apply_writes(writes)
        blocks = read_car(res.car).blocks
        assert invert_ops(blocks, res.data, res.ops) == before
