"""``firehose.jetstream``'s subscriber options and client messages (pure: no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import pytest

from firehose.jetstream import (
    MAX_CLIENT_MESSAGE_BYTES,
    MAX_HEARTBEAT_PAYLOAD,
    MAX_WANTED_COLLECTIONS,
    MAX_WANTED_DIDS,
    ClientMessage,
    JetstreamOptions,
    JetstreamOptionsError,
    heartbeat_message,
    parse_client_message,
    parse_max_size,
    parse_options,
)
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
    assert info.value.message == "message is nested too deeply"


def _refusal(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(JetstreamOptionsError) as info:
        call()
    return info.value.reason, info.value.message


BAD = Reason.JETSTREAM_BAD_MESSAGE


@pytest.mark.parametrize(("message", "reason", "text"), [
    ("{", BAD, "message is not JSON"),
    ("[1]", BAD, "message must be an object with a type"),
    ('{"type": 1}', BAD, "message must be an object with a type"),
    ('{"type": "options_update"}', BAD, "options_update needs an object payload"),
    ('{"type": "options_update", "payload": {"wantedCollections": "app.bsky.feed.post"}}', BAD,
     "wantedCollections must be an array"),
    ('{"type": "options_update", "payload": {"wantedDids": "did:plc:x"}}', BAD, "wantedDids must be an array"),
    ('{"type": "options_update", "payload": {"wantedCollections": [1]}}', Reason.JETSTREAM_BAD_COLLECTION,
     "wantedCollections must be strings"),
    ('{"type": "options_update", "payload": {"maxMessageSizeBytes": "big"}}', Reason.JETSTREAM_BAD_MAX_SIZE,
     "maxMessageSizeBytes must be an integer"),
    ('{"type": "heartbeat", "payload": "' + "x" * 82 + '"}', BAD, "heartbeat payload too long"),
])
def test_every_refused_client_message_has_its_reason_and_text(message: str, reason: str, text: str) -> None:
    """The reason is counted and the text is the close reason the client reads: both exact."""
    assert _refusal(lambda: parse_client_message(message)) == (reason, text)


def test_client_message_bounds_are_inclusive() -> None:
    """A message of exactly ``MAX_CLIENT_MESSAGE_BYTES`` is read, one byte more is refused; a
    heartbeat payload of exactly ``MAX_HEARTBEAT_PAYLOAD`` bytes is echoed."""
    head = '{"type": "note", "payload": "'
    exact = head + "x" * (MAX_CLIENT_MESSAGE_BYTES - len(head) - 2) + '"}'
    assert len(exact) == MAX_CLIENT_MESSAGE_BYTES
    assert parse_client_message(exact) == ClientMessage("note")
    assert parse_client_message(exact.encode()) == ClientMessage("note")
    assert _refusal(lambda: parse_client_message(exact + " ")) == (BAD, "message too large")
    beat = parse_client_message(json.dumps({"type": "heartbeat", "payload": "y" * MAX_HEARTBEAT_PAYLOAD}))
    assert beat == ClientMessage("heartbeat", payload="y" * MAX_HEARTBEAT_PAYLOAD)
    assert parse_client_message('{"type": "heartbeat", "payload": 5}') == ClientMessage("heartbeat", payload="")
    update = parse_client_message('{"type": "options_update", "payload": {}}')
    assert update == ClientMessage("options_update", options=JetstreamOptions())


def test_option_refusals_and_limits() -> None:
    """Each refusal's reason and text (the 400 body names it); the counts are inclusive bounds;
    ``maxMessageSizeBytes`` is clamped to 0 … 2³¹-1 (negative: no limit, as in Jetstream)."""
    assert _refusal(lambda: parse_options(["app.bsky.feed.post*"], [])) == (
        Reason.JETSTREAM_BAD_COLLECTION, "invalid collection 'app.bsky.feed.post*'")
    assert _refusal(lambda: parse_options(["app..x.*"], [])) == (Reason.JETSTREAM_BAD_COLLECTION,
                                                            "invalid collection prefix 'app..x.*'")
    assert _refusal(lambda: parse_options(["app.b-.*"], [])) == (Reason.JETSTREAM_BAD_COLLECTION,
                                                                 "invalid collection prefix 'app.b-.*'")
    long = "app." + "b" * 300
    assert _refusal(lambda: parse_options([long + "-"], [])) == (Reason.JETSTREAM_BAD_COLLECTION,
                                                                 f"invalid collection {long[:120]!r}")
    assert _refusal(lambda: parse_options([long + "-.*"], [])) == (Reason.JETSTREAM_BAD_COLLECTION,
                                                                   f"invalid collection prefix {long[:120]!r}")
    assert _refusal(lambda: parse_options([], ["did:nope"])) == (Reason.JETSTREAM_BAD_DID, "invalid DID 'did:nope'")
    assert _refusal(lambda: parse_options([], [7])) == (Reason.JETSTREAM_BAD_DID, "invalid DID '7'")
    assert _refusal(lambda: parse_options([], ["did:" + "x" * 300])) == (Reason.JETSTREAM_BAD_DID,
                                                                         f"invalid DID {('did:' + 'x' * 116)!r}")
    names = [f"app.bsky.c{i}.post" for i in range(MAX_WANTED_COLLECTIONS)]
    assert len(parse_options(names, []).collections) == MAX_WANTED_COLLECTIONS
    assert len(parse_options(names[:-1] + ["app.bsky.z.*"], []).prefixes) == 1
    assert _refusal(lambda: parse_options(names + ["app.bsky.z.*"], [])) == (
        Reason.JETSTREAM_TOO_MANY_COLLECTIONS, f"at most {MAX_WANTED_COLLECTIONS} wantedCollections")
    dids = [f"did:plc:{i:024d}" for i in range(MAX_WANTED_DIDS)]
    assert len(parse_options([], dids + dids[:1]).dids) == MAX_WANTED_DIDS  # a repeated DID counts once
    assert _refusal(lambda: parse_options([], [*dids, "did:plc:" + "z" * 24])) == (
        Reason.JETSTREAM_TOO_MANY_DIDS, f"at most {MAX_WANTED_DIDS} wantedDids")
    both = parse_options(["app.bsky.feed.*", "app.*", "app.bsky.feed.*"], [])
    assert both.prefixes == ("app.", "app.bsky.feed.")  # once each, shortest first
    assert [parse_max_size(v) for v in (None, "", -5, "-5", 0, 12, "12", 2**40)] == [0, 0, 0, 0, 0, 12, 12, 2**31 - 1]
    for bad in (True, 1.5, "1.5", [1]):
        assert _refusal(partial(parse_max_size, bad)) == (Reason.JETSTREAM_BAD_MAX_SIZE,
                                                          "maxMessageSizeBytes must be an integer")
    exact = JetstreamOptions(collections=frozenset({"app.bsky.feed.post"}))
    assert exact.wants_collection("app.bsky.feed.post") and not exact.wants_collection("app.bsky.feed.like")


def test_a_heartbeat_is_echoed_as_jetstream_sends_it() -> None:
    assert heartbeat_message("hi") == b'{"kind":"heartbeat","payload":"hi"}'
