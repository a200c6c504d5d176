"""The JSON stream's conversion cache is bounded in bytes (README, "Memory budgets"): converted
messages and their compressed forms, counted as each is made, never exceed ``cache_bytes``; the
least recently used events go first, and one event larger than the whole bound is not kept."""

from __future__ import annotations

import time

from firehose.frames import encode_frame
from firehose.jetstream import JetstreamConverter, JetstreamOptions, ZstdCodec, select
from firehose.state import SequencedEvent
from tests.firehose.commits import commit_body, new_repo


def events(n: int, text_bytes: int) -> list[SequencedEvent]:
    from mst.repo import Write

    repo = new_repo("did:plc:jsoncachebound00000000001")
    out = []
    for seq in range(1, n + 1):
        r = repo.apply_writes([Write("create", "app.bsky.feed.post", f"3k{seq:011d}",
                                     {"$type": "app.bsky.feed.post", "text": f"{seq} " + "j" * text_bytes})])
        out.append(SequencedEvent(seq, repo.did, "#commit", time.time(), encode_frame("#commit", commit_body(repo, r, seq))))
    return out


def test_converted_and_compressed_messages_stay_within_the_cache_bytes() -> None:
    legacy, current = ZstdCodec.legacy(), ZstdCodec.default()
    bound = 40_000
    conv = JetstreamConverter(legacy, current, cache_bytes=bound)
    evs = events(60, 3_000)  # ~3 KB of JSON each: about a dozen fit
    for i in range(0, len(evs), 5):
        batch = evs[i:i + 5]
        for dict_id in (None, legacy.dict_id, current.dict_id):  # plain, then each compressed form
            got = select(conv, batch, JetstreamOptions(), dict_id)
            assert len(got.messages) == len(batch)
            assert conv.cached_bytes <= bound
    assert conv.stats.compressed == 2 * len(evs)
    assert conv.cached_bytes > bound // 2  # it is used, not emptied
    assert conv.stats.cache_hits >= 2 * len(evs)  # each batch converted once for its three forms
    assert conv.event(evs[-1]).size > len(conv.event(evs[-1]).messages[0].data)  # compressed forms counted


def test_an_event_larger_than_the_bound_is_converted_but_not_kept() -> None:
    conv = JetstreamConverter(ZstdCodec.default(), cache_bytes=2_000)
    ev = events(1, 5_000)[0]
    assert len(select(conv, [ev], JetstreamOptions(), None).messages) == 1
    assert conv.cached_bytes == 0
    select(conv, [ev], JetstreamOptions(), None)
    assert conv.stats.converted == 2  # converted again: nothing was kept
