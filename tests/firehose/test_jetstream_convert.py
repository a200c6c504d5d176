"""``firehose.jetstream``'s conversion, selection and time cursors, without sockets.

Conversions are checked against ``tests.relay.jetstream_oracle`` (the Jetstream documentation
applied to the frames, decoded with other libraries), never against the relay's own code; time
cursors against a real store (SQLite and PostgreSQL) and the broadcaster's replay rules.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

import pytest

from firehose.broadcast import ERROR_KIND, Broadcaster
from firehose.frames import decode_frame, encode_frame
from firehose.jetstream import JetstreamConverter, ZstdCodec, convert, parse_options, select, seq_for_time
from firehose.state import SequencedEvent
from mst.cid import CID
from mst.repo import Write
from tests.firehose.test_broadcast_live import ReadLog
from tests.relay import jetstream_oracle as oracle

from .commits import commit_body, new_repo, posts, sync_body
from .conftest import Ingest

pytestmark = pytest.mark.timeout(60)

DID = "did:plc:jetstreamconvert000000001"
OTHER = "did:plc:jetstreamconvert000000002"


def stream() -> list[SequencedEvent]:
    """Stored events of every kind Jetstream carries and one it does not, 1 s apart (and 0.7 µs
    past the second, which ``time_us`` rounds up)."""
    repo = new_repo(DID)
    other = new_repo(OTHER)
    bodies: list[tuple[str, str, dict[str, Any]]] = []
    r = repo.apply_writes(posts(2))  # one commit, two creates
    bodies.append(("#commit", DID, commit_body(repo, r)))
    r = repo.apply_writes([Write("update", "app.bsky.feed.post", "3k00000000000",
                                 {"$type": "app.bsky.feed.post", "text": "edited é"})])
    bodies.append(("#commit", DID, commit_body(repo, r)))
    r = other.apply_writes([Write("create", "app.bsky.graph.follow", "3kfollow00001",
                                  {"$type": "app.bsky.graph.follow", "subject": DID, "createdAt": "2026-01-01T00:00:00.000Z"})])
    bodies.append(("#commit", OTHER, commit_body(other, r)))
    r = repo.apply_writes([Write("delete", "app.bsky.feed.post", "3k00000000001")])
    bodies.append(("#commit", DID, commit_body(repo, r)))
    # one commit of many ops: a delete before creates, a record with a link and bytes, a long
    # record before a short one, posts before a follow
    image = CID.cidv1_raw_sha256_32_from(hashlib.sha256(b"an image").digest())
    r = repo.apply_writes([
        Write("delete", "app.bsky.feed.post", "3k00000000000"),
        Write("create", "app.bsky.feed.post", "3k00000000005",
              {"$type": "app.bsky.feed.post", "text": "long " * 80, "raw": b"\x00\x01\xfe",
               "image": {"$type": "blob", "ref": image, "mimeType": "image/jpeg", "size": 8}}),
        Write("create", "app.bsky.feed.post", "3k00000000006", {"$type": "app.bsky.feed.post", "text": "short"}),
        Write("create", "app.bsky.graph.follow", "3kfollow00002",
              {"$type": "app.bsky.graph.follow", "subject": OTHER, "createdAt": "2026-01-01T00:00:00.000Z"}),
    ])
    assert [op.action for op in r.ops] == ["delete", "create", "create", "create"]
    bodies.append(("#commit", DID, commit_body(repo, r)))
    bodies.append(("#identity", DID, {"did": DID, "handle": "alice.example.com", "time": "2026-01-01T00:00:00.000Z"}))
    bodies.append(("#identity", OTHER, {"did": OTHER, "time": "2026-01-01T00:00:00.000Z"}))  # no handle
    bodies.append(("#account", DID, {"did": DID, "active": False, "status": "takendown",
                                     "time": "2026-01-01T00:00:00.000Z"}))
    bodies.append(("#account", OTHER, {"did": OTHER, "active": True, "time": "2026-01-01T00:00:00.000Z"}))
    bodies.append(("#sync", DID, sync_body(repo, r)))  # not a Jetstream message
    out = []
    for seq, (kind, did, body) in enumerate(bodies, start=1):
        body = {**body, "seq": seq}
        out.append(SequencedEvent(seq, did, kind, 1_767_225_600.0 + seq + 0.0000007,
                                  encode_frame(kind, body)))
    return out


def parsed(messages: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(m) for m in messages]


def documented(events: list[SequencedEvent]) -> list[dict[str, Any]]:
    """What the oracle says each event becomes, with the event's time in microseconds."""
    times = {ev.seq: round(ev.time * 1_000_000) for ev in events}
    return [{**m, "time_us": times[m["_seq"]]} for m in oracle.expected(ev.frame for ev in events)]


def same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The same messages, ``time_us`` included, in the same order."""
    assert got == [{k: v for k, v in m.items() if k != "_seq"} for m in want]


def test_every_event_converts_as_jetstream_documents() -> None:
    events = stream()
    want = documented(events)
    got = [json.loads(m.data) for ev in events for m in convert(ev).messages]
    same(got, want)
    assert [list(m) for m in got[:1]] == [["did", "time_us", "kind", "commit"]]  # Jetstream's key order
    assert {m["kind"] for m in got} == {"commit", "identity", "account"}
    assert {m["commit"]["operation"] for m in got if m["kind"] == "commit"} == {"create", "update", "delete"}
    assert got[-1]["time_us"] == 1_767_225_609_000_001  # the microsecond nearest to the time
    for ev in events:  # what each message is filed under: its collection, none for the others
        cols = [m.collection for m in convert(ev).messages]
        assert cols == [json.loads(m.data).get("commit", {}).get("collection") for m in convert(ev).messages]
        for m in convert(ev).messages:  # compact JSON, UTF-8 as is
            assert m.data == json.dumps(json.loads(m.data), separators=(",", ":"), ensure_ascii=False).encode()
    text = convert(events[1]).messages[0].data
    assert "edited é".encode() in text  # UTF-8, not \u escapes


def test_select_applies_every_filter_and_the_size_bound() -> None:
    events = stream()
    conv = JetstreamConverter(ZstdCodec.default())
    want = documented(events)
    assert parse_options([], []).dids == frozenset()
    everything = select(conv, events, parse_options([], []), None)
    same(parsed(everything.messages), want)
    assert everything.bytes == sum(len(m) for m in everything.messages)
    for collections, dids in ((["app.bsky.feed.post"], []), (["app.bsky.graph.*"], []), ([], [OTHER]),
                              (["app.bsky.feed.post"], [OTHER])):
        got = select(conv, events, parse_options(collections, dids), None)
        same(parsed(got.messages), [m for m in want if oracle.wanted(m, collections, dids)])
    for limit in sorted({len(m) for m in everything.messages}):  # the bound is inclusive
        bounded = select(conv, events, parse_options([], [], limit), None)
        assert bounded.messages == [m for m in everything.messages if len(m) <= limit]
    codec = ZstdCodec.legacy()
    conv = JetstreamConverter(codec)
    packed = select(conv, events, parse_options([], []), codec.dict_id)
    assert [oracle.decompress(m, codec.dictionary) for m in packed.messages] == parsed(everything.messages)
    assert packed.bytes == sum(len(m) for m in packed.messages)


def test_commits_convert_op_by_op() -> None:
    """A delete needs no block (a commit without blocks still gives its deletes); a create whose
    record block is missing gives nothing, and the ops after it are still converted; a frame
    stored leniently (an integer past int64, which the strict rules refuse) still converts."""
    bare = {"seq": 1, "repo": DID, "rev": "3kaaaaaaaaaa2", "since": None, "blocks": b"", "time": "2026-01-01T00:00:00Z",
            "ops": [{"action": "delete", "path": "app.bsky.feed.post/3kdeleted0001", "cid": None}]}
    ev = SequencedEvent(1, DID, "#commit", 2.0, encode_frame("#commit", bare))
    assert [json.loads(m.data) for m in convert(ev).messages] == [
        {"did": DID, "time_us": 2_000_000, "kind": "commit",
         "commit": {"rev": "3kaaaaaaaaaa2", "operation": "delete", "collection": "app.bsky.feed.post",
                    "rkey": "3kdeleted0001"}}]
    whole = stream()[4]  # the commit of four ops
    body = decode_frame(whole.frame).body
    missing = CID.cidv1_dag_cbor_sha256_32_from(hashlib.sha256(b"not in the blocks").digest())
    body = {**body, "ops": [{"action": "create", "path": "app.bsky.feed.post/3kmissing0001", "cid": missing},
                            *body["ops"]], "big": 2**63 + 5}
    tampered = SequencedEvent(whole.seq, DID, "#commit", whole.time, encode_frame("#commit", body))
    assert [m.data for m in convert(tampered).messages] == [m.data for m in convert(whole).messages]
    assert len(convert(whole).messages) == 4


def test_an_undecodable_stored_frame_is_counted_logged_and_sends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    good = stream()[5]
    bad = SequencedEvent(99, DID, "#identity", good.time, good.frame[:-3])
    worse = SequencedEvent(100, DID, "#identity", good.time, good.frame[:-4])
    conv = JetstreamConverter(ZstdCodec.default())
    with caplog.at_level(logging.WARNING, logger="firehose.jetstream"):
        for _ in range(2):  # the second time from the cache, the failed ones included
            got = select(conv, [bad, good, worse], parse_options([], []), None)
            assert got.messages == [m.data for m in convert(good).messages]
    stats = conv.stats
    assert (stats.failed, stats.converted, stats.cache_hits) == (2, 3, 3)
    logged = [(r.getMessage(), r.fields) for r in caplog.records]  # type: ignore[attr-defined]
    assert [(msg, f["seq"]) for msg, f in logged] == [("jetstream: event not converted", 99),
                                                      ("jetstream: event not converted", 100)]
    assert all(f["error"].startswith("FrameError(") for _, f in logged), logged


class TrimmedMidway(ReadLog):
    """A trim that runs while a time cursor is looked up: everything stored goes just after the
    window's start is read."""

    async def oldest_seq(self) -> int | None:
        oldest = await self.store.oldest_seq()
        await self.store.trim(older_than_seconds=0, now=1e12)
        return oldest


async def times_at(ingest: Ingest, *seconds: float) -> None:
    for t in seconds:
        await ingest.add(1, when=t)


async def test_a_time_cursor_is_the_seq_before_the_first_event_at_or_after_it(ingest: Ingest) -> None:
    """Inclusive of ``time_us``; the whole window for a time before it; the latest seq (live,
    nothing replayed) for a time after the newest event."""
    await times_at(ingest, 10, 10, 20, 20, 30, 40, 50)  # seqs 1..7
    store = ingest.store
    s = 1_000_000
    cases = {0: 0, 10 * s: 0, 10 * s + 1: 2, 20 * s - 1: 2, 20 * s: 2, 20 * s + 1: 4, 30 * s: 4, 35 * s: 5,
             40 * s: 5, 50 * s: 6, 50 * s + 1: 7, 99 * s: 7}
    assert {at: await seq_for_time(store, at) for at in cases} == cases
    for at in cases:  # a binary search over whole seqs: at most 1 + log2(7) reads, each of a seq
        counted = ReadLog(store)
        assert type(await seq_for_time(counted, at)) is int
        assert len(counted.reads) <= 3 and all(type(seq) is int and limit == 1 for seq, limit in counted.reads)
    await store.trim(older_than_seconds=0, now=25)  # seqs 1..4 gone
    assert await store.oldest_seq() == 5
    assert await seq_for_time(store, 0) == 4  # the window's start: no OutdatedCursor
    assert await seq_for_time(store, 35 * s) == 5
    # trimmed from under the search: the start of what was the window (the replay then says
    # OutdatedCursor if events it held are gone)
    assert await seq_for_time(TrimmedMidway(store), 35 * s) == 4
    assert await store.oldest_seq() is None  # everything gone: live from the latest seq
    assert await seq_for_time(store, 0) == 7


async def test_a_time_cursor_on_an_empty_store_gets_the_first_events(ingest: Ingest) -> None:
    """A time cursor taken before anything was stored starts at the first event: not after seq
    1 (the first event lost), not ahead of the stream (a FutureCursor the JSON stream cannot
    send)."""
    b = Broadcaster(ingest.store, ingest.bus)
    await b.start()
    session = b.session(await seq_for_time(ingest.store, 1_700_000_000_000_000))
    await ingest.add(3)
    batches = session.event_batches()
    got: list[SequencedEvent] = []
    try:
        async with asyncio.timeout(30):
            async for batch in batches:  # until the last one stored, or the error that ends it
                got.extend(batch)
                if got[-1].seq in (0, 3):
                    break
    finally:
        await batches.aclose()
        await b.close()
    assert [ev.kind for ev in got] != [] and ERROR_KIND not in {ev.kind for ev in got}
    assert [decode_frame(ev.frame).body["seq"] for ev in got] == [1, 2, 3]
