"""``firehose.framing``: splicing ``seq`` into a pre-encoded body gives exactly the bytes of a full
re-encoding (checked against cbrrr, an independent encoder, over generated bodies), and the
sequencer's pre-encoded path stores the same frames as its dict path."""

from __future__ import annotations

import string
from typing import Any

import cbrrr
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.sequencer import Sequencer
from backfill.store import Store
from firehose.framing import (
    FramingError,
    encode_unsequenced,
    frame_header,
    seq_offset,
    splice_seq,
)
from tests.backfill.conftest import decode_frame
from tests.backfill.helpers import Collector, commit_event
from tests.hypothesis_budget import examples

CID = cbrrr.CID.cidv1_dag_cbor_sha256_32_from(b"framing")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=30),
    st.binary(max_size=300),
    st.just(CID),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Keys around "seq" in canonical order: short ones, three-letter ones on both sides, long ones.
keys = st.one_of(
    st.text(alphabet=string.ascii_lowercase, min_size=0, max_size=2),
    st.text(alphabet=string.ascii_lowercase, min_size=3, max_size=3),
    st.sampled_from(["ops", "rev", "did", "seq", "sez", "seb", "sf", "repo", "blocks", "prevData"]),
    st.text(max_size=30),
)
bodies = st.dictionaries(keys, values, max_size=30).map(lambda d: {k: v for k, v in d.items() if k != "seq"})
seqs = st.one_of(
    st.integers(min_value=0, max_value=300),
    st.integers(min_value=0, max_value=2**53 - 1),
    st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 - 1]),
)


@settings(max_examples=examples(400), deadline=None)
@given(body=bodies, seq=seqs)
def test_splice_equals_full_reencoding(body: dict[str, Any], seq: int) -> None:
    encoded = cbrrr.encode_dag_cbor(body)
    expected = cbrrr.encode_dag_cbor({**body, "seq": seq})
    assert splice_seq(encoded, seq) == expected  # walking the keys
    data, offset = encode_unsequenced(body)
    assert data == encoded and seq_offset(encoded) == offset
    assert splice_seq(data, seq, at=offset) == expected  # producer-supplied offset
    header = frame_header("#commit")
    assert splice_seq(memoryview(data), seq, header, offset) == header + expected


# Deterministic companions of the property test (which runs few examples under mutation testing):
# every head width of every kind of value that a key sorting before "seq" can hold, each seq width.
_HEAD_WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
_LENGTHS = [0, 23, 24, 255, 256, 65535, 65536]
WALKED_VALUES: list[Any] = [
    *_HEAD_WIDTHS,
    *(-1 - n for n in _HEAD_WIDTHS),
    *(b"b" * n for n in _LENGTHS),
    *("t" * n for n in _LENGTHS),
    True, False, None, 1.5, CID, [], [1, [2, CID]], {"k": b"v", "kk": [None]},
]
WALKED_KEYS = ["", "a", "ab", "é", "aé", "did", "ops", "rev", "sep"]  # all sort before "seq"
SEQ_WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**53 - 1]


def _check_splice(body: dict[str, Any], seq: int) -> int:
    """Both splice paths give the full re-encoding; returns where ``seq`` went."""
    encoded = cbrrr.encode_dag_cbor(body)
    expected = cbrrr.encode_dag_cbor({**body, "seq": seq})
    assert splice_seq(encoded, seq) == expected
    data, offset = encode_unsequenced(body)
    assert data == encoded and seq_offset(encoded) == offset
    assert splice_seq(encoded, seq, b"pre", offset) == b"pre" + expected
    return offset


@pytest.mark.parametrize("value", WALKED_VALUES, ids=lambda v: f"{type(v).__name__}-{len(v) if isinstance(v, (bytes, str, list, dict)) else v}")
def test_every_head_width_before_seq_is_walked(value: Any) -> None:
    """A key sorting before ``seq`` with each kind and head width of value, alone or followed by
    keys on both sides of ``seq``: the walk lands where a full re-encoding puts ``seq``, and
    every cut short of that spot is ``truncated_body``, never a frame."""
    for i, key in enumerate(WALKED_KEYS):
        seq = SEQ_WIDTHS[i % len(SEQ_WIDTHS)]
        alone = {key: value}
        assert _check_splice(alone, seq) == len(cbrrr.encode_dag_cbor(alone))
        body = {key: value, "z": 0, "sez": 1, "éé": 2, "zzzz": 3}
        offset = _check_splice(body, seq)
        encoded = cbrrr.encode_dag_cbor(body)
        cuts = range(offset + 1) if offset <= 48 else [*range(24), *range(offset - 24, offset + 1)]
        for cut in cuts:
            with pytest.raises(FramingError) as info:
                splice_seq(encoded[:cut], seq)
            assert info.value.reason == "truncated_body", (key, cut)
            with pytest.raises(FramingError) as info:
                seq_offset(encoded[:cut])
            assert info.value.reason == "truncated_body", (key, cut)


@pytest.mark.parametrize("entries", [0, 1, 22, 23, 24, 254, 255, 256, 65535, 65536])
def test_every_map_head_width(entries: int) -> None:
    """Map heads of every width, and the ones that grow by a byte when ``seq`` is added."""
    body = {f"k{i:05d}": i for i in range(entries - 1)}
    if entries:
        body["a"] = 1  # walked
    assert len(body) == entries
    _check_splice(body, entries)


def test_keys_sort_by_utf8_bytes_length_first() -> None:
    """Canonical order is by UTF-8 bytes: "é" (2 bytes) and "aé" (3, below "seq") go before
    ``seq``; "éé" (4 bytes, 2 characters) and "sé" (3, above "seq") after it."""
    body = {"é": 1, "aé": 2, "éé": 3, "sé": 4, "seqq": 5}
    offset = _check_splice(body, 9)
    assert offset == len(cbrrr.encode_dag_cbor({"é": 1, "aé": 2}))  # one-byte map heads both


def test_offsets_at_both_ends_of_the_body_are_accepted() -> None:
    """``at`` may be the first entry (every key sorts after ``seq``) or the very end (every key
    sorts before it); one byte outside either end is ``bad_offset``."""
    after = cbrrr.encode_dag_cbor({"zzzz": 1})
    assert splice_seq(after, 3, at=1) == cbrrr.encode_dag_cbor({"zzzz": 1, "seq": 3})
    before = cbrrr.encode_dag_cbor({"a": 1})
    assert splice_seq(before, 3, at=len(before)) == cbrrr.encode_dag_cbor({"a": 1, "seq": 3})
    big = cbrrr.encode_dag_cbor({f"k{i:05d}": i for i in range(30)})  # a two-byte map head
    assert splice_seq(big, 3, at=2) == cbrrr.encode_dag_cbor({**{f"k{i:05d}": i for i in range(30)}, "seq": 3})
    for data, at in ((after, 0), (big, 1), (before, len(before) + 1)):
        with pytest.raises(FramingError) as info:
            splice_seq(data, 3, at=at)
        assert info.value.reason == "bad_offset"


def test_encode_unsequenced_refuses_a_body_with_seq() -> None:
    with pytest.raises(FramingError) as info:
        encode_unsequenced({"a": 1, "seq": 2})
    assert info.value.reason == "seq_present"


def test_map_header_grows_past_23_entries() -> None:
    body = {f"k{i:02d}": i for i in range(23)}  # 23 entries + seq = 24: two-byte map head
    encoded = cbrrr.encode_dag_cbor(body)
    assert encoded[0] == 0xB7
    spliced = splice_seq(encoded, 7)
    assert spliced[:2] == b"\xb8\x18" and spliced == cbrrr.encode_dag_cbor({**body, "seq": 7})
    assert seq_offset(encoded) == len(encoded)


@pytest.mark.parametrize(
    ("data", "seq", "reason"),
    [
        (cbrrr.encode_dag_cbor([1, 2]), 1, "body_not_map"),
        (b"", 1, "truncated_body"),
        (b"\xb8", 1, "truncated_body"),  # a map head cut inside its one-byte count
        (b"\xb9\x01", 1, "truncated_body"),  # ... inside its two-byte count
        (cbrrr.encode_dag_cbor({"seq": 1}), 2, "seq_present"),
        (cbrrr.encode_dag_cbor({"ops": [1, 2, 3]})[:-2], 1, "truncated_body"),
        (cbrrr.encode_dag_cbor({"a": 1}), -1, "bad_seq"),
        (cbrrr.encode_dag_cbor({"a": 1}), 2**53, "bad_seq"),
        (cbrrr.encode_dag_cbor({"a": 1}), True, "bad_seq"),
    ],
)
def test_bad_input_is_a_typed_error(data: bytes, seq: Any, reason: str) -> None:
    with pytest.raises(FramingError) as info:
        splice_seq(data, seq)
    assert info.value.reason == reason


@pytest.mark.parametrize("data", [
    b"\xbf\x61a\x01\xff",  # an indefinite-length map
    b"\xa2\x61a\x5f\x41x\xff\x64zzzz\x01",  # an indefinite-length byte string before "seq"
    b"\xa2\x61a\x1c\x64zzzz\x01",  # a reserved additional information (28) before "seq"
    b"\xa2\x01\x02\x64zzzz\x01",  # an integer key
], ids=["indefinite-map", "indefinite-bytes", "reserved-info", "integer-key"])
def test_indefinite_lengths_and_non_text_keys_are_not_a_map(data: bytes) -> None:
    """Not canonical DAG-CBOR: ``body_not_map``, from both the splice and the offset walk."""
    for call in (lambda: splice_seq(data, 1), lambda: seq_offset(data)):
        with pytest.raises(FramingError) as info:
            call()
        assert info.value.reason == "body_not_map"


def test_offset_out_of_range_is_rejected() -> None:
    data = cbrrr.encode_dag_cbor({"a": 1})
    with pytest.raises(FramingError) as info:
        splice_seq(data, 1, at=len(data) + 1)
    assert info.value.reason == "bad_offset"


async def test_sequencer_pre_encoded_bodies_store_the_same_frames(store: Store) -> None:
    """The same events through the dict path and the body_cbor path give identical frames."""
    plain = [commit_event(n, did=f"did:plc:f{n}") for n in range(1, 31)]
    spliced = [commit_event(n, did=f"did:plc:f{n}") for n in range(1, 31)]
    for i, event in enumerate(spliced):
        event.body_cbor, offset = encode_unsequenced(event.body)
        event.seq_offset = offset if i % 2 else None  # with and without the producer's offset
        event.body = {}  # not read on this path
    published = Collector()
    async with Sequencer(store, published) as seq:
        for event in spliced:
            await seq.enqueue(event)
    replay = await store.read_after(0, 100)
    assert [e.seq for e in replay] == list(range(1, 31))
    for stored, original in zip(replay, plain, strict=True):
        header, body = decode_frame(stored.frame)
        assert header == {"op": 1, "t": "#commit"} and body["seq"] == stored.seq
        assert stored.frame == frame_header("#commit") + cbrrr.encode_dag_cbor(
            {**original.body, "seq": stored.seq}
        )
    assert [e.frame for e in published.events] == [e.frame for e in replay]
    account = await store.get_account("did:plc:f30")
    assert account is not None and account.rev == plain[-1].rev
