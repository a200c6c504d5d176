"""``backfill.collections.CollectionChanges``: a ``#commit``'s ops counted from the
``op_changes`` its validation worker computed, or (without them) from its encoded body — the same
counts either way, in event order."""

from __future__ import annotations

from backfill.collections import CollectionChanges
from firehose.framing import encode_unsequenced
from firehose.state import PendingEvent, commit_op_changes

DID = "did:plc:collectionchanges00000"
OPS = [
    {"action": "create", "path": "app.bsky.feed.post/3k1", "cid": None},
    {"action": "create", "path": "app.bsky.feed.like/3k2", "cid": None},
    {"action": "delete", "path": "app.bsky.feed.post/3k3", "cid": None},
    {"action": "update", "path": "app.bsky.actor.profile/self", "cid": None},
    {"action": "bogus", "path": "app.bsky.feed.post/3k4", "cid": None},  # skipped
    {"action": "create", "path": "", "cid": None},  # no collection: skipped
    "not an op",  # skipped
]


def _event(op_changes: tuple[tuple[str, str], ...] | None, body_cbor: bytes) -> PendingEvent:
    return PendingEvent("#commit", DID, {}, "3kaaaaaaaaaaa", body_cbor=body_cbor, op_changes=op_changes)


def test_worker_changes_and_the_encoded_body_give_the_same_counts() -> None:
    body_cbor, _ = encode_unsequenced({"ops": OPS, "repo": DID, "rev": "3kaaaaaaaaaaa"})
    from_body, from_worker = CollectionChanges(), CollectionChanges()
    from_body.add(_event(None, body_cbor))
    from_worker.add(_event(commit_op_changes(OPS), body_cbor))
    expected = [("app.bsky.feed.post", DID, 0, 0), ("app.bsky.feed.like", DID, 1, 1),
                ("app.bsky.actor.profile", DID, 0, 1)]
    assert from_body.deltas() == expected
    assert from_worker.deltas() == expected


def test_given_changes_are_used_without_decoding_the_body() -> None:
    """With ``op_changes`` the body is not read: bytes that are not CBOR at all still count."""
    changes = CollectionChanges()
    changes.add(_event((("app.bsky.graph.follow", "create"),), b"\xff not cbor"))
    assert changes.deltas() == [("app.bsky.graph.follow", DID, 1, 1)]
