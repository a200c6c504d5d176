"""Blocks nothing references are dropped from what the relay redistributes (``firehose.prune``):
a padded commit is accepted (the draft allows extra blocks) but cannot amplify its frame."""

from __future__ import annotations

import time

from firehose.frames import decode_frame
from firehose.pipeline import validate_and_encode
from firehose.prune import Recording, prune_slice, referenced
from firehose.validate import MAX_BLOBS, identity_body, outgoing_body, validate_frame
from mst import cbor
from mst.car import read_car, write_car
from mst.cid import CID, cid_for_cbor
from mst.repo import Write
from mst.verify import verify_repo_car

from .commits import commit_body, frame, new_repo, posts, state_of, sync_body


def _padded(body: dict, n: int, extra_roots: int = 0) -> dict:  # type: ignore[type-arg]
    """``body`` with ``n`` small blocks nothing references appended to its slice."""
    car = read_car(body["blocks"])
    junk = [cbor.encode({"junk": i}) for i in range(n)]
    roots = car.roots + [cid_for_cbor(j) for j in junk[:extra_roots]]
    blocks = list(car.blocks.items()) + [(cid_for_cbor(j), j) for j in junk]
    return {**body, "blocks": write_car(roots, blocks)}


def _out_blocks(verdict) -> bytes:  # type: ignore[no-untyped-def]
    assert verdict.body_cbor is not None
    return cbor.decode(verdict.body_cbor)["blocks"]  # type: ignore[index, no-any-return]


def test_commit_with_many_unreferenced_blocks_is_accepted_and_sent_without_them() -> None:
    repo = new_repo()
    genesis = repo.genesis
    res = repo.apply_writes(posts(3))
    plain = commit_body(repo, res)
    padded = _padded(plain, 40_000, extra_roots=3)
    assert len(padded["blocks"]) > 1_000_000
    verdict = validate_and_encode(frame(padded), state_of(repo, genesis), repo.key.did_key(), time.time())
    assert verdict.kind == "accept" and verdict.blocks is not None
    out = read_car(_out_blocks(verdict))
    assert out.roots == [res.commit_cid]
    assert out.blocks == read_car(plain["blocks"]).blocks  # exactly what the producer needed to send
    assert len(verdict.body_cbor or b"") < len(plain["blocks"]) + 1000
    # and what goes out still verifies for a consumer: inversion, signature, chain
    again = validate_frame(frame({**plain, "blocks": _out_blocks(verdict)}), state_of(repo, genesis),
                           repo.key.did_key(), time.time())
    assert again.kind == "accept"


def test_unpadded_commits_go_out_as_received() -> None:
    repo = new_repo()
    prev = repo.genesis
    live: list[str] = []
    for i in range(30):
        writes = posts(4, start=10 * i)
        if i % 3 == 2:
            writes = [Write("delete", "app.bsky.feed.post", live.pop(0), None)]
        elif i % 5 == 4:
            writes = [Write("update", "app.bsky.feed.post", live[-1], {"text": "edited"})]
        else:
            live += [w.rkey for w in writes]
        res = repo.apply_writes(writes)
        body = commit_body(repo, res)
        verdict = validate_and_encode(frame(body), state_of(repo, prev), repo.key.did_key(), time.time())
        assert verdict.kind == "accept", verdict
        assert verdict.blocks is None and _out_blocks(verdict) is not None
        assert _out_blocks(verdict) == body["blocks"]
        prev = res


def test_record_block_no_op_names_is_dropped() -> None:
    repo = new_repo()
    genesis = repo.genesis
    res = repo.apply_writes(posts(2))
    plain = commit_body(repo, res)
    stray = cbor.encode({"$type": "app.bsky.feed.post", "text": "deleted long ago"})
    car = read_car(plain["blocks"])
    body = {**plain, "blocks": write_car(car.roots, [*car.blocks.items(), (cid_for_cbor(stray), stray)])}
    verdict = validate_and_encode(frame(body), state_of(repo, genesis), repo.key.did_key(), time.time())
    assert verdict.kind == "accept"
    assert cid_for_cbor(stray) not in read_car(_out_blocks(verdict)).blocks
    assert read_car(_out_blocks(verdict)).blocks.keys() == car.blocks.keys()


def test_sync_keeps_only_its_commit_block() -> None:
    repo = new_repo()
    res = repo.apply_writes(posts(2))
    sync = sync_body(repo, res)
    verdict = validate_and_encode(frame(sync, "#sync"), None, repo.key.did_key(), time.time())
    assert verdict.kind == "accept" and verdict.blocks is None
    padded = _padded(sync, 20)
    assert len(padded["blocks"]) < 10_000
    verdict = validate_and_encode(frame(padded, "#sync"), None, repo.key.did_key(), time.time())
    assert verdict.kind == "accept" and verdict.blocks is not None
    assert list(read_car(_out_blocks(verdict)).blocks) == [res.commit_cid]


def test_deprecated_fields_and_identity_extras_cannot_pad_a_frame() -> None:
    repo = new_repo()
    res = repo.apply_writes(posts(1))
    plain = commit_body(repo, res)
    cid = res.commit_cid
    padded = {**plain, "rebase": "x" * 100_000, "tooBig": [1] * 1000, "blobs": [cid] * (MAX_BLOBS + 1)}
    out = outgoing_body("#commit", padded)
    assert out["rebase"] is False and out["tooBig"] is False and out["blobs"] == []
    assert outgoing_body("#commit", {**plain, "blobs": ["x" * 1000]})["blobs"] == []
    kept = outgoing_body("#commit", {**plain, "blobs": [cid] * 3, "rebase": True})
    assert kept["blobs"] == [cid] * 3 and kept["rebase"] is True
    assert outgoing_body("#commit", {**plain, "blobs": None})["blobs"] is None
    ident = {"seq": 5, "did": repo.did, "time": "2026-01-01T00:00:00Z", "handle": "a.example.com",
             "padding": b"x" * 1_000_000}
    assert identity_body(ident, True) == {"did": repo.did, "time": ident["time"], "handle": "a.example.com"}
    assert identity_body(ident, False) == {"did": repo.did, "time": ident["time"]}


def test_full_repository_still_verifies_from_the_pruned_commits() -> None:
    """A consumer rebuilding the repository from what went out has every block it needs."""
    repo = new_repo()
    prev = repo.genesis
    blocks: dict[CID, bytes] = dict(read_car(commit_body(repo, prev)["blocks"]).blocks)
    for i in range(10):
        res = repo.apply_writes(posts(3, start=5 * i))
        verdict = validate_and_encode(frame(_padded(commit_body(repo, res), 50)), state_of(repo, prev),
                                      repo.key.did_key(), time.time())
        assert verdict.kind == "accept"
        blocks.update(read_car(_out_blocks(verdict)).blocks)
        prev = res
    full = write_car([prev.commit_cid], blocks.items())
    verified = verify_repo_car(full, repo.did, repo.key.public_key)
    assert set(verified.records) == set(repo.records())
    assert decode_frame(frame(commit_body(repo, prev))).t == "#commit"


def _block(obj: object) -> tuple[CID, bytes]:
    data = cbor.encode(obj)
    return cid_for_cbor(data), data


def test_prune_slice_and_referenced_on_their_own() -> None:
    """The functions' own contract, beside what validation guarantees before calling them: a
    record CID the slice does not hold is not counted as present (the fast path would otherwise
    take the slice as complete and let an unreferenced block through); extra roots are dropped
    even when every block is needed; every node reachable from the root is kept even when one is
    linked twice (a signed but malformed node must not stop the walk early)."""
    commit_cid, commit = _block({"commit": 1})
    junk_cid, junk = _block({"junk": 1})
    absent, _ = _block({"record": "not in the slice"})
    car = read_car(write_car([commit_cid], [(commit_cid, commit), (junk_cid, junk)]))
    assert absent not in referenced(car, commit_cid, None, [absent, None])
    pruned = prune_slice(car, commit_cid, None, [absent, None])
    assert pruned is not None and pruned[1] == 1
    assert read_car(pruned[0]).blocks == {commit_cid: commit}
    # every block needed, but a second root: rewritten with the commit as the only root
    two_roots = read_car(write_car([commit_cid, junk_cid], [(commit_cid, commit)]))
    pruned = prune_slice(two_roots, commit_cid, None, ())
    assert pruned is not None and pruned[1] == 0 and read_car(pruned[0]).roots == [commit_cid]
    # a node whose links are, in its bytes, t: x, t: c, l: c — the walk pops c twice before x
    x_cid, x = _block({"e": [{"k": b"x", "p": 0, "t": None, "v": absent}], "l": None})
    c_cid, c = _block({"e": [{"k": b"c", "p": 0, "t": None, "v": absent}], "l": None})
    entry = {"k": b"a", "p": 0, "t": x_cid, "v": absent}
    node_cid, node = _block({"e": [entry, {**entry, "k": b"b", "t": c_cid}], "l": c_cid})
    assert x_cid != c_cid
    tree = read_car(write_car([commit_cid], [(commit_cid, commit), (node_cid, node), (x_cid, x), (c_cid, c)]))
    assert referenced(tree, commit_cid, node_cid, []) == {commit_cid, node_cid, x_cid, c_cid}


def test_recording_names_the_blocks_read() -> None:
    """``Recording``: a read-only view of the blocks that names exactly the ones read (``get`` of a
    present block, ``[]``), not those only tested for, iterated or missing."""
    (a, block_a), (b, block_b) = _block({"a": 1}), _block({"b": 2})
    missing, _ = _block({"c": 3})
    view = Recording({a: block_a, b: block_b})
    assert a in view and missing not in view and list(view) == [a, b] and len(view) == 2
    assert view.seen == set()
    assert view.get(missing) is None and view.get(missing, b"x") == b"x"
    assert view.get(a) == block_a and view[b] == block_b
    assert view.seen == {a, b}
