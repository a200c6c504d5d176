"""What the relay redistributes for an accepted event: lexicon fields only, pre-encoded for seq
splicing (``firehose.validate.outgoing_body``, ``firehose.pipeline.validate_and_encode``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from firehose.frames import encode_frame
from firehose.framing import frame_header, splice_seq
from firehose.pipeline import ValidationPool, validate_and_encode
from firehose.validate import outgoing_body

from .commits import commit_body, flip_sig, frame, new_repo, posts, state_of, sync_body


def _extended(body: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "aa": 1, "zzz": [1, 2], "extraField": {"x": b"y"}}
    out["ops"] = [{**op, "junk": "j"} for op in body["ops"]]
    return out


def test_outgoing_body_keeps_lexicon_fields_only() -> None:
    repo = new_repo()
    res = repo.apply_writes(posts(2))
    plain = commit_body(repo, res, seq=77)
    out = outgoing_body("#commit", _extended(plain))
    assert out == {k: v for k, v in plain.items() if k != "seq"}
    assert out["blocks"] is plain["blocks"]
    sync = sync_body(repo, res, seq=5)
    assert outgoing_body("#sync", {**sync, "other": 1}) == {k: v for k, v in sync.items() if k != "seq"}


@pytest.mark.parametrize("extended", [False, True])
def test_accepted_commit_is_encoded_for_splicing(extended: bool) -> None:
    repo = new_repo()
    genesis = repo.genesis
    res = repo.apply_writes(posts(3))
    plain = commit_body(repo, res, seq=900)
    body = _extended(plain) if extended else plain
    verdict = validate_and_encode(frame(body), state_of(repo, genesis), repo.key.did_key(), time.time())
    assert verdict.kind == "accept"
    assert verdict.body_cbor is not None and verdict.seq_offset is not None
    expected = {k: v for k, v in plain.items() if k != "seq"}
    spliced = splice_seq(verdict.body_cbor, 12345, frame_header("#commit"), verdict.seq_offset)
    assert spliced == encode_frame("#commit", {**expected, "seq": 12345})


def test_accepted_sync_is_encoded_and_rejects_carry_no_body() -> None:
    repo = new_repo()
    res = repo.apply_writes(posts(1))
    sync = sync_body(repo, res, seq=3)
    verdict = validate_and_encode(frame({**sync, "x": 1}, "#sync"), None, repo.key.did_key(), time.time())
    assert verdict.kind == "accept" and verdict.body_cbor is not None
    spliced = splice_seq(verdict.body_cbor, 7, frame_header("#sync"), verdict.seq_offset)
    assert spliced == encode_frame("#sync", {**{k: v for k, v in sync.items() if k != "seq"}, "seq": 7})
    bad = flip_sig(commit_body(repo, repo.apply_writes(posts(1, start=50)), seq=4))
    rejected = validate_and_encode(frame(bad), state_of(repo, res), repo.key.did_key(), time.time())
    assert rejected.kind == "reject" and rejected.body_cbor is None and rejected.seq_offset is None


@pytest.mark.parametrize("workers", [0, 1])
async def test_pipeline_verdicts_carry_the_encoded_body(workers: int) -> None:
    repo = new_repo()
    genesis = repo.genesis
    res = repo.apply_writes(posts(2))
    plain = commit_body(repo, res, seq=10)
    async with ValidationPool(workers) as pipeline:
        verdict = await pipeline.judge(frame(_extended(plain)), state_of(repo, genesis), repo.key.did_key())
    assert verdict.kind == "accept" and verdict.body_cbor is not None
    expected = {k: v for k, v in plain.items() if k != "seq"}
    assert splice_seq(verdict.body_cbor, 1, frame_header("#commit"), verdict.seq_offset) == encode_frame(
        "#commit", {**expected, "seq": 1})
    assert verdict.new_state is not None and verdict.new_state.rev == res.rev


def test_outgoing_body_of_other_types_drops_only_seq() -> None:
    """The contract for a type without a field list (``#identity``/``#account`` bodies are built
    elsewhere, but a caller may pass any): everything but the upstream ``seq`` is kept as is."""
    body = {"seq": 9, "did": "did:plc:x", "time": "2026-01-01T00:00:00Z", "active": True, "other": [1]}
    assert outgoing_body("#account", body) == {"did": "did:plc:x", "time": "2026-01-01T00:00:00Z", "active": True,
                                               "other": [1]}
