"""Frame codec: round trips, error/#info frames, limits, unknown op/t, fuzz."""

from __future__ import annotations

import cbrrr
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firehose.frames import (
    MAX_FRAME_BYTES,
    FrameError,
    decode_frame,
    encode_error_frame,
    encode_frame,
    encode_info_frame,
)
from firehose.reasons import ALL_REASONS, Reason
from tests.hypothesis_budget import examples


def test_round_trip_message_frame_is_canonical() -> None:
    body = {"seq": 7, "repo": "did:plc:abc", "blocks": b"\x00\x01", "ops": [], "tooBig": False}
    data = encode_frame("#commit", body)
    assert data.startswith(cbrrr.encode_dag_cbor({"op": 1, "t": "#commit"}))
    f = decode_frame(data)
    assert (f.op, f.t, f.body) == (1, "#commit", body)
    assert f.ignored_reason is None and not f.is_error
    assert encode_frame("#commit", f.body) == data


def test_blocks_bytes_are_copied_verbatim() -> None:
    blocks = bytes(range(256)) * 40
    data = encode_frame("#commit", {"seq": 1, "blocks": blocks})
    assert blocks in data


def test_error_and_info_frames() -> None:
    f = decode_frame(encode_error_frame("FutureCursor", "ahead"))
    assert f.is_error and f.t is None and f.error == "FutureCursor" and f.body["message"] == "ahead"
    i = decode_frame(encode_info_frame("OutdatedCursor"))
    assert i.t == "#info" and i.body == {"name": "OutdatedCursor"}
    i = decode_frame(encode_info_frame("OutdatedCursor", "too old"))
    assert i.t == "#info" and i.body == {"name": "OutdatedCursor", "message": "too old"}


def test_unknown_op_and_type_are_ignorable_not_errors() -> None:
    f = decode_frame(cbrrr.encode_dag_cbor({"op": 2, "t": "#commit"}) + cbrrr.encode_dag_cbor({}))
    assert f.ignored_reason == Reason.UNKNOWN_OP
    g = decode_frame(encode_frame("#future", {"x": 1, "extra": [1, 2]}))
    assert g.ignored_reason == Reason.UNKNOWN_TYPE
    h = decode_frame(cbrrr.encode_dag_cbor({"op": 2, "t": 5}) + cbrrr.encode_dag_cbor({}))
    assert (h.op, h.t, h.ignored_reason) == (2, None, Reason.UNKNOWN_OP)  # a type that is no text is no type


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", Reason.FRAME_EMPTY),
        (b"\xff", Reason.BAD_HEADER_CBOR),
        (cbrrr.encode_dag_cbor([1]) + cbrrr.encode_dag_cbor({}), Reason.HEADER_NOT_MAP),
        (cbrrr.encode_dag_cbor({"op": "1", "t": "#x"}) + cbrrr.encode_dag_cbor({}), Reason.BAD_HEADER_OP),
        (cbrrr.encode_dag_cbor({"op": 1}) + cbrrr.encode_dag_cbor({}), Reason.MISSING_HEADER_TYPE),
        (cbrrr.encode_dag_cbor({"op": 1, "t": "#commit"}), Reason.BAD_BODY_CBOR),
        (cbrrr.encode_dag_cbor({"op": 1, "t": "#commit"}) + cbrrr.encode_dag_cbor([1]), Reason.BODY_NOT_MAP),
        (encode_frame("#commit", {}) + b"\x00", Reason.TRAILING_BYTES),
        (cbrrr.encode_dag_cbor({"op": -1}) + cbrrr.encode_dag_cbor({"message": "x"}), Reason.MISSING_FIELD),
        # non-canonical: map keys out of order
        (bytes.fromhex("a2626f70016174622378") + b"\xa0", Reason.BAD_HEADER_CBOR),
    ],
)
def test_malformed_frames_are_typed_errors(data: bytes, reason: Reason) -> None:
    with pytest.raises(FrameError) as err:
        decode_frame(data)
    assert err.value.reason == reason


def test_frame_size_limit() -> None:
    big = encode_frame("#commit", {"blocks": b"x" * MAX_FRAME_BYTES})
    with pytest.raises(FrameError) as err:
        decode_frame(big)
    assert err.value.reason == Reason.FRAME_TOO_LARGE
    ok = encode_frame("#commit", {"blocks": b"x" * (MAX_FRAME_BYTES - 100)})
    assert decode_frame(ok).t == "#commit"


@settings(max_examples=examples(400), deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_typed_errors(data: bytes) -> None:
    try:
        decode_frame(data)
    except FrameError as exc:
        assert exc.reason in ALL_REASONS


@settings(max_examples=examples(400), deadline=None)
@given(st.data())
def test_fuzz_mutated_frames_only_typed_errors(data: st.DataObject) -> None:
    frame = bytearray(encode_frame("#commit", {"seq": 5, "repo": "did:plc:x", "blocks": b"abc", "ops": [{"a": None}]}))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(frame)))
    try:
        decode_frame(bytes(frame[:cut]))
    except FrameError as exc:
        assert exc.reason in ALL_REASONS


def test_lenient_decode_leaves_drisl_extras_to_validation() -> None:
    from cbrrr import CID

    odd = CID(bytes.fromhex("01701220") + b"\x11" * 32)  # dag-pb codec: not a blessed atproto CID
    data = encode_frame("#commit", {"seq": 1, "commit": odd})
    with pytest.raises(FrameError) as err:
        decode_frame(data)
    assert err.value.reason == Reason.BAD_BODY_CBOR
    assert decode_frame(data, strict=False).body["commit"] == odd
    in_header = cbrrr.encode_dag_cbor({"op": 1, "t": "#commit", "x": odd}) + cbrrr.encode_dag_cbor({"seq": 1})
    with pytest.raises(FrameError) as err:
        decode_frame(in_header)  # the header is judged by the same rules
    assert err.value.reason == Reason.BAD_HEADER_CBOR
    assert decode_frame(in_header, strict=False).body == {"seq": 1}
    for bad in (b"\xff", bytes.fromhex("a2626f70016174622378") + b"\xa0", encode_frame("#x", {}) + b"\x00"):
        with pytest.raises(FrameError):
            decode_frame(bad, strict=False)  # still canonical DAG-CBOR only


def test_a_cbor_error_names_what_the_decoder_refused() -> None:
    """The frame error's message is the strict decoder's own reason (or, lenient, the error type
    cbrrr raised): what a rejected frame's detail tells an operator."""
    unordered = bytes.fromhex("a2626f70016174622378") + b"\xa0"
    details = []
    for data in (unordered, b"\xff"):
        for strict in (True, False):
            with pytest.raises(FrameError) as err:
                decode_frame(data, strict=strict)
            details.append((err.value.reason, err.value.message))
    assert details == [(Reason.BAD_HEADER_CBOR, "cbor_map_key_order"), (Reason.BAD_HEADER_CBOR, "CbrrrDecodeError"),
                       (Reason.BAD_HEADER_CBOR, "cbor_simple_value"), (Reason.BAD_HEADER_CBOR, "CbrrrDecodeError")]


def test_every_frame_error_has_its_reason_and_detail() -> None:
    """Reason and detail of each refusal (the detail is what a rejected frame's log shows), in
    both decoders; the size bound is inclusive."""
    header = cbrrr.encode_dag_cbor({"op": 1, "t": "#commit"})
    cases: list[tuple[object, tuple[str, str]]] = [
        ("text", (Reason.BAD_HEADER_CBOR, "not binary")),
        (header, (Reason.BAD_BODY_CBOR, "no payload")),
        (cbrrr.encode_dag_cbor({"op": -1}) + cbrrr.encode_dag_cbor({"message": "x"}), (Reason.MISSING_FIELD, "error")),
        (cbrrr.encode_dag_cbor({"op": -1}) + cbrrr.encode_dag_cbor({"error": 5}), (Reason.MISSING_FIELD, "error")),
    ]
    for strict in (True, False):
        for data, expected in cases:
            with pytest.raises(FrameError) as err:
                decode_frame(data, strict=strict)  # type: ignore[arg-type]
            assert (err.value.reason, err.value.message) == expected
    frame = encode_frame("#commit", {"seq": 1})
    for strict in (True, False):
        assert decode_frame(frame, max_bytes=len(frame), strict=strict).body == {"seq": 1}
        with pytest.raises(FrameError) as err:
            decode_frame(frame, max_bytes=len(frame) - 1, strict=strict)
        assert (err.value.reason, err.value.message) == (Reason.FRAME_TOO_LARGE, f"{len(frame)} bytes")
