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


def held(conv: JetstreamConverter) -> dict[int, int]:
    """What the cache holds: each kept event's seq and counted size."""
    out = {}
    for seq in list(conv._cache):
        kept = conv._cache.peek(seq)
        assert kept is not None
        out[seq] = kept.size
    return out


def test_compressed_forms_are_made_once_and_counted_exactly() -> None:
    """Each compressed form is made once per dictionary and added to its event's size; the cache's
    count is the sum of what it holds, also when making room for a grown event evicts others (the
    grown event itself is never evicted for its own growth)."""
    legacy, current = ZstdCodec.legacy(), ZstdCodec.default()
    evs = events(3, 3_000)
    conv = JetstreamConverter(legacy, current, cache_bytes=10**9)
    jets = [conv.event(ev) for ev in evs]
    plain = [j.size for j in jets]
    msg = jets[0].messages[0]
    first = conv.zstd(msg, None, jets[0])  # None: the `compress=true` dictionary
    assert conv.zstd(msg, legacy.dict_id, jets[0]) is first and conv.stats.compressed == 1
    own = conv.zstd(msg, current.dict_id, jets[0])
    assert own != first and conv.stats.compressed == 2
    assert jets[0].size == plain[0] + len(first) + len(own)
    assert held(conv) == {1: jets[0].size, 2: plain[1], 3: plain[2]} and conv.cached_bytes == sum(held(conv).values())
    # a bound that fits the three plain events and little more: event 1 (the least recently used) grows
    tight = JetstreamConverter(legacy, current, cache_bytes=sum(plain) + 10)
    tjets = [tight.event(ev) for ev in evs]
    packed = tight.zstd(tjets[0].messages[0], legacy.dict_id, tjets[0])
    kept = held(tight)
    assert 1 in kept and kept[1] == plain[0] + len(packed)  # the grown event stays, the oldest others go
    assert tight.cached_bytes == sum(kept.values()) <= tight.cache_bytes


def test_the_cache_bounds_are_inclusive_and_its_count_follows_evictions() -> None:
    """Events fill the cache up to exactly ``cache_bytes`` and ``cache_size`` (both inclusive);
    beyond them the least recently used go, and the byte count stays the sum of what is held.
    By default it holds at most 20,000 events and 64 MiB."""
    evs = [events(n, 200 * n)[n - 1] for n in range(1, 5)]  # seqs 1..4, each larger than the one before
    sizes = [JetstreamConverter(ZstdCodec.default()).event(ev).size for ev in evs]
    assert sizes == sorted(set(sizes))
    exact = JetstreamConverter(ZstdCodec.default(), cache_bytes=sizes[0] + sizes[1])
    for ev in evs[:2]:
        exact.event(ev)
    assert held(exact) == {1: sizes[0], 2: sizes[1]}  # exactly full: both kept
    exact.event(evs[2])
    assert held(exact) == {3: sizes[2]}  # event 3 is larger than event 1: both 1 and 2 go
    assert exact.cached_bytes == sum(held(exact).values())
    one = JetstreamConverter(ZstdCodec.default(), cache_bytes=sizes[0])
    one.event(evs[0])
    assert held(one) == {1: sizes[0]}  # one event of exactly the bound is kept
    counted = JetstreamConverter(ZstdCodec.default(), cache_size=2)
    for ev in evs:
        counted.event(ev)
    assert held(counted) == {3: sizes[2], 4: sizes[3]}
    assert counted.cached_bytes == sizes[2] + sizes[3]
    default = JetstreamConverter(ZstdCodec.default())
    assert (default._cache.maxsize, default.cache_bytes) == (20_000, 64 * 1024 * 1024)
