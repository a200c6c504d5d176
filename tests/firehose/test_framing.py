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
