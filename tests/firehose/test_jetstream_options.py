"""``firehose.jetstream``'s subscriber options and client messages (pure: no sockets)."""

from __future__ import annotations

import json

import pytest

from firehose.jetstream import JetstreamOptionsError, parse_client_message, parse_options
from firehose.reasons import Reason


def test_a_prefix_matches_whole_name_segments_only() -> None:
    """``app.bsky.feed.*`` is every collection under ``app.bsky.feed.``, as Jetstream documents:
    not ``app.bsky.feedgen…`` nor ``app.bsky.feed`` itself."""
    options = parse_options(["app.bsky.feed.*"], [])
    assert options.wants_collection("app.bsky.feed.post")
    assert options.wants_collection("app.bsky.feed.generator")
    assert options.wants_collection("app.bsky.feed.threadgate.v2")
    assert not options.wants_collection("app.bsky.feedgen.post")
    assert not options.wants_collection("app.bsky.feedgenerator")
    assert not options.wants_collection("app.bsky.feed")
    assert not options.wants_collection("app.bsky.graph.follow")
    assert options.wants_collection(None)  # identity and account messages pass every filter
    top = parse_options(["app.*"], [])
    assert top.wants_collection("app.bsky.feed.post") and not top.wants_collection("apples.x.y")


def test_a_prefix_update_matches_whole_name_segments_only() -> None:
    update = parse_client_message(json.dumps({"type": "options_update",
                                              "payload": {"wantedCollections": ["app.bsky.feed.*"]}}))
    assert update.options is not None
    assert update.options.wants_collection("app.bsky.feed.like")
    assert not update.options.wants_collection("app.bsky.feedgen.like")


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_a_deeply_nested_options_update_is_refused_with_a_reason(depth: int) -> None:
    """JSON nested deeper than the parser's recursion allows is a typed refusal, not a crash."""
    nested = "[" * depth + "]" * depth
    message = '{"type": "options_update", "payload": {"wantedCollections": ' + nested + "}}"
    with pytest.raises(JetstreamOptionsError) as info:
        parse_client_message(message)
    assert info.value.reason == Reason.JETSTREAM_BAD_MESSAGE
    assert "nested" in info.value.message
