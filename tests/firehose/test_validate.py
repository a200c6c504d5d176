"""Validation: recorded relay scenarios, every tampered variant with its own reason, fuzz."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import cbrrr
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from firehose.reasons import ALL_REASONS, Reason
from firehose.state import AccountState
from firehose.validate import EMPTY_TREE_ROOT, Verdict, validate_frame
from mst import native
from mst.car import read_car, write_car
from mst.cid import cid_for_cbor
from mst.crypto import PrivateKey, parse_did_key, parse_multibase_key
from mst.repo import Write
from mst.tid import TidClock, tid_to_micros
from tests.hypothesis_budget import examples

from .commits import commit_body, flip_sig, frame, new_repo, posts, rewrite_car, state_of, sync_body


def now() -> float:
    """The validator's clock, read when each frame is judged: a module-level constant went stale
    when collection and the test were minutes apart (a loaded machine), and commits made with the
    real clock were then judged "rev in the future"."""
    return time.time()


def run_scenario(path: Path) -> list[tuple[Verdict, dict]]:
    doc = json.loads(path.read_text())
    keys = {}
    for acct in doc["accounts"]:
        k = acct["identity"]["keys"]["atproto"]
        keys[acct["identity"]["did"]] = parse_multibase_key(k["type"], k["publicKeyMultibase"]).did_key()
    states: dict[str, AccountState] = {}
    out = []
    for m in doc["messages"]:
        hdr, body = m["frame"]["header"], m["frame"]["body"]
        raw = cbrrr.encode_dag_cbor(hdr, atjson_mode=True) + cbrrr.encode_dag_cbor(body, atjson_mode=True)
        did = body.get("did") or body.get("repo")
        v = validate_frame(raw, states.get(did), keys[did], now())
        if v.new_state is not None:
            states[did] = v.new_state
        out.append((v, m))
    return out


@pytest.mark.parametrize("name", ["post_lifecycle.json", "account_lifecycle.json"])
def test_recorded_scenarios_give_expected_verdicts(fixtures_dir: Path, name: str) -> None:
    results = run_scenario(fixtures_dir / "indigo-relay-scenarios" / name)
    assert results
    for v, m in results:
        expect_pass = not m["drop"] and not m["invalid"]
        assert (v.kind == "accept") == expect_pass, (m["frame"]["header"], v)
    commits = [v for v, m in results if m["frame"]["header"]["t"] == "#commit"]
    if commits:  # the chain was checked against state, not just accepted blindly
        assert all(v.new_state is not None and v.new_state.sync_state == "synced" for v in commits)


def test_scenario_tamper_is_caught(fixtures_dir: Path) -> None:
    doc = json.loads((fixtures_dir / "indigo-relay-scenarios" / "post_lifecycle.json").read_text())
    k = doc["accounts"][0]["identity"]["keys"]["atproto"]
    key = parse_multibase_key(k["type"], k["publicKeyMultibase"]).did_key()
    m = doc["messages"][0]["frame"]
    body = cbrrr.decode_dag_cbor(cbrrr.encode_dag_cbor(m["body"], atjson_mode=True))
    body["ops"] = []  # dropped op
    v = validate_frame(frame(body), None, key, now())
    assert (v.kind, v.reason) == ("reject", Reason.INVERSION_MISMATCH)


# --- a repo with history, and the commit under test --------------------------------------------

@pytest.fixture(scope="module")
def chain():
    repo = new_repo()
    first = repo.apply_writes(posts(40))
    before = state_of(repo, first)
    r = repo.apply_writes(
        [*posts(3, start=100, text="new"), Write("update", "app.bsky.feed.post", "3k00000000001", {"text": "edited"}),
         Write("delete", "app.bsky.feed.post", "3k00000000002")]
    )
    after = repo.apply_writes(posts(1, start=200))
    return repo, before, r, after


def judge(body: dict, state: AccountState | None, key: str, at: float | None = None) -> Verdict:
    return validate_frame(frame(body), state, key, now() if at is None else at)


def test_valid_commit_is_accepted_with_new_state(chain) -> None:
    repo, before, r, _ = chain
    at = now()
    v = judge(commit_body(repo, r), before, repo.key.did_key(), at)
    assert (v.kind, v.reason) == ("accept", "ok")
    assert v.new_state == dataclasses.replace(
        before, rev=r.rev, commit_cid=r.commit_cid.encode(), data_cid=r.data.encode(), updated_at=at
    )


def test_valid_commits_are_inverted_by_the_native_path(chain) -> None:
    """With the native path built (``./run test`` requires it), a valid commit's operations are
    inverted by ``mst._accel``, which declines a block map that is not a plain ``dict``: the
    reference inversion's key-height cache (only the reference fills it) stays empty. Under
    ``RELAY_PURE_PYTHON`` the reference runs and fills it."""
    node = sys.modules["mst._native_node" if native.active() else "mst._node"]
    repo, before, r, _ = chain
    body = commit_body(repo, r)
    node._HEIGHTS.clear()
    v = judge(body, before, repo.key.did_key())
    assert (v.kind, v.reason) == ("accept", "ok")
    if os.environ.get("RELAY_PURE_PYTHON", "").lower() in ("1", "true", "yes"):
        assert node._HEIGHTS
    else:
        assert native.ACCEL, native.ACCEL_STATUS
        assert not node._HEIGHTS, len(node._HEIGHTS)


def test_valid_commits_never_fall_back_to_the_reference_inversion(chain) -> None:
    """With the native path on, a valid commit's inversion never falls back to the reference (a
    wrapper around the blocks would make the C code decline every commit, silently ~3x slower)."""
    import firehose.validate as validate
    from mst import native

    repo, before, r, after = chain
    start = validate.reference_inversions
    assert judge(commit_body(repo, r), before, repo.key.did_key()).kind == "accept"
    assert judge(commit_body(repo, after), state_of(repo, r), repo.key.did_key()).kind == "accept"
    assert validate.reference_inversions == start + (0 if native.ACCEL else 2)


def test_first_commit_of_unknown_account_is_accepted() -> None:
    repo = new_repo("did:plc:brandnewaccount00000000001")
    assert repo.genesis is not None
    v = judge(commit_body(repo, repo.genesis), None, repo.key.did_key())
    assert v.kind == "accept"
    r = repo.apply_writes(posts(2))
    v = judge(commit_body(repo, r), None, repo.key.did_key())  # mid-stream, state unknown
    assert v.kind == "accept" and v.new_state.rev == r.rev


def _tampered(chain) -> dict[str, tuple[dict, AccountState | None, str]]:
    repo, before, r, after = chain
    key = repo.key.did_key()
    good = commit_body(repo, r)
    records = {op.cid for op in r.ops if op.cid is not None}
    other_key = PrivateKey.generate_k256().did_key()
    cases: dict[str, tuple[dict, AccountState | None, str]] = {}
    cases[Reason.BAD_SIGNATURE] = (flip_sig(good), before, key)
    cases["wrong_key"] = (good, before, other_key)
    cases[Reason.INVERSION_MISMATCH] = ({**good, "ops": good["ops"][:-1]}, before, key)  # dropped op
    extra = {"action": "create", "path": "app.bsky.feed.like/3kaaaaaaaaaaa", "cid": next(iter(records))}
    cases[Reason.INVERSION_INVALID_OP] = ({**good, "ops": [*good["ops"], extra]}, before, key)  # extra op
    cases[Reason.PREV_DATA_WRONG] = ({**good, "prevData": r.data}, before, key)  # wrong prevData
    cases[Reason.COMMIT_CID_MISMATCH] = ({**good, "commit": cid_for_cbor(b"\xa0")}, before, key)
    cases[Reason.CAR_ROOT_MISMATCH] = (rewrite_car(good, roots=[next(iter(records))]), before, key)
    cases[Reason.MISSING_MST_BLOCK] = (rewrite_car(good, drop={r.data}), before, key)
    cases[Reason.MISSING_RECORD_BLOCK] = (rewrite_car(good, drop={next(iter(records))}), before, key)
    cases[Reason.BAD_BLOCK_HASH] = (rewrite_car(good, corrupt=next(iter(records))), before, key)
    cases[Reason.COMMIT_DID_MISMATCH] = ({**good, "repo": "did:plc:someoneelse000000000000"}, None, key)
    cases[Reason.COMMIT_REV_MISMATCH] = ({**good, "rev": after.rev}, before, key)
    cases[Reason.MISSING_PREV_DATA] = ({k: v for k, v in good.items() if k != "prevData"}, before, key)
    cases[Reason.TOO_MANY_OPS] = ({**good, "ops": good["ops"] * 41}, before, key)  # 205 > 200
    cases[Reason.DUPLICATE_OP_PATH] = ({**good, "ops": [*good["ops"], good["ops"][0]]}, before, key)
    cases[Reason.BAD_SINCE] = ({**good, "since": "not-a-tid"}, before, key)
    cases[Reason.BAD_DID] = ({**good, "repo": "not a did"}, before, key)
    cases[Reason.BAD_DATETIME] = ({**good, "time": "yesterday"}, before, key)
    cases[Reason.MISSING_FIELD] = ({k: v for k, v in good.items() if k != "blocks"}, before, key)
    cases[Reason.BAD_CAR] = ({**good, "blocks": b"\x00\x01garbage"}, before, key)
    cases[Reason.BAD_OP_CID] = ({**good, "ops": [{**good["ops"][0], "cid": None}]}, before, key)
    cases[Reason.BAD_SIGNING_KEY] = (good, before, "did:key:zNotAKey")
    junk = b"\x82\x01\x02"  # valid DAG-CBOR, but a list, not a record map
    junk_cid = cid_for_cbor(junk)
    car = read_car(good["blocks"])
    bad_record = {**good, "blocks": write_car(car.roots, [*car.blocks.items(), (junk_cid, junk)]),
                  "ops": [{"action": "create", "path": "app.bsky.feed.post/3kzzzzzzzzzzz", "cid": junk_cid},
                          *good["ops"]]}
    cases[Reason.BAD_RECORD] = (bad_record, before, key)
    return cases


def test_every_tampered_variant_is_rejected_with_its_own_reason(chain) -> None:
    seen = {}
    for expected, (body, state, key) in _tampered(chain).items():
        v = judge(body, state, key)
        want = Reason.BAD_SIGNATURE if expected == "wrong_key" else expected
        assert (v.kind, v.reason) == ("reject", want), (expected, v)
        seen[expected] = v.reason
    distinct = {r for e, r in seen.items() if e != "wrong_key"}
    assert len(distinct) == len(seen) - 1


def test_size_limits() -> None:
    repo = new_repo("did:plc:sizelimits0000000000000001")
    key = repo.key.did_key()
    big = repo.apply_writes([Write("create", "app.bsky.feed.post", "3kbig00000000", {"blob": b"x" * 1_000_100})])
    assert judge(commit_body(repo, big), None, key).reason == Reason.RECORD_TOO_LARGE
    huge = repo.apply_writes(
        [Write("create", "app.bsky.feed.post", f"3khuge{i:07d}", {"blob": bytes([i]) * 700_000}) for i in range(3)]
    )
    assert len(huge.car) > 2_000_000
    assert judge(commit_body(repo, huge), None, key).reason == Reason.BLOCKS_TOO_LARGE
    many = repo.apply_writes(posts(201, start=500))
    v = judge(commit_body(repo, many), None, key)
    assert (v.kind, v.reason) == ("reject", Reason.TOO_MANY_OPS)
    ok = repo.apply_writes(posts(200, start=900))
    assert judge(commit_body(repo, ok), None, key).kind == "accept"


def test_rev_in_the_future_is_rejected() -> None:
    future_us = int((now() + 3600) * 1_000_000)
    repo = new_repo("did:plc:futurerev0000000000000001", TidClock(now_micros=lambda: future_us))
    r = repo.apply_writes(posts(1))
    v = judge(commit_body(repo, r), None, repo.key.did_key())
    assert (v.kind, v.reason) == ("reject", Reason.REV_IN_FUTURE)
    near = int((now() + 60) * 1_000_000)  # within the clock-drift window
    repo2 = new_repo("did:plc:futurerev0000000000000002", TidClock(now_micros=lambda: near))
    assert judge(commit_body(repo2, repo2.apply_writes(posts(1))), None, repo2.key.did_key()).kind == "accept"


def test_signing_key_as_text_or_parsed(chain) -> None:
    """The key may come as ``did:key`` text or already parsed (the same verdict); text that is no
    key is rejected ``bad_signing_key`` with the parser's reason as detail."""
    repo, before, r, _ = chain
    body, key = commit_body(repo, r), repo.key.did_key()
    assert judge(body, before, key).kind == "accept"
    assert validate_frame(frame(body), before, parse_did_key(key), now()).kind == "accept"
    v = judge(body, before, "did:key:zNotAKey")
    assert (v.kind, v.reason, v.detail) == ("reject", Reason.BAD_SIGNING_KEY, "key_unsupported_curve")


def test_rev_in_the_future_limit_is_inclusive() -> None:
    """A rev exactly ``max_clock_skew`` (300 s) ahead of the validator's clock is accepted; one
    second more is rejected (whole seconds: exact in floating point)."""
    repo = new_repo("did:plc:futurerev0000000000000003", TidClock(now_micros=lambda: 1_799_999_999_999_999))
    r = repo.apply_writes(posts(1))
    assert tid_to_micros(r.rev) == 1_800_000_000_000_000
    body, key = commit_body(repo, r), repo.key.did_key()
    assert judge(body, None, key, at=1_800_000_000.0 - 300).kind == "accept"
    v = judge(body, None, key, at=1_800_000_000.0 - 301)
    assert (v.kind, v.reason) == ("reject", Reason.REV_IN_FUTURE)


def test_rev_not_increasing_is_ignored(chain) -> None:
    repo, before, r, after = chain
    key = repo.key.did_key()
    applied = state_of(repo, after)
    v = judge(commit_body(repo, r), applied, key)  # an older commit arrives late
    assert (v.kind, v.reason) == ("ignore", Reason.REV_NOT_INCREASING)
    v = judge(commit_body(repo, after), applied, key)  # the same commit again
    assert (v.kind, v.reason) == ("ignore", Reason.DUPLICATE_EVENT)


def test_since_not_chaining_marks_desynchronized(chain) -> None:
    repo, before, r, after = chain
    key = repo.key.did_key()
    v = judge(commit_body(repo, after), before, key)  # we missed commit r
    assert (v.kind, v.reason) == ("desync", Reason.SINCE_MISMATCH)
    assert v.new_state is not None and v.new_state.sync_state == "desynchronized" and v.new_state.rev == before.rev
    wrong_data = dataclasses.replace(before, data_cid=EMPTY_TREE_ROOT.encode())
    v = judge(commit_body(repo, r), wrong_data, key)
    assert (v.kind, v.reason) == ("desync", Reason.PREV_DATA_MISMATCH)
    resyncing = dataclasses.replace(before, sync_state="resyncing")
    assert judge(commit_body(repo, r), resyncing, key).reason == Reason.RESYNC_IN_PROGRESS


def test_inactive_accounts_are_ignored(chain) -> None:
    repo, before, r, _ = chain
    for state in (dataclasses.replace(before, upstream_status="deactivated"),
                  dataclasses.replace(before, local_status="takendown")):
        v = judge(commit_body(repo, r), state, repo.key.did_key())
        assert (v.kind, v.reason) == ("ignore", Reason.ACCOUNT_INACTIVE)


def test_sync_messages(chain) -> None:
    repo, before, r, after = chain
    key = repo.key.did_key()
    v = validate_frame(frame(sync_body(repo, after), "#sync"), before, key, now())
    assert (v.kind, v.reason) == ("accept", Reason.SYNC_RESET)  # jumps over r: state reset
    assert v.new_state.rev == after.rev and v.new_state.data_cid == after.data.encode()
    v = validate_frame(frame(sync_body(repo, r), "#sync"), state_of(repo, r), key, now())
    assert (v.kind, v.reason) == ("ignore", Reason.SYNC_ROLLBACK)
    v = validate_frame(frame(sync_body(repo, after), "#sync"), None, PrivateKey.generate_p256().did_key(), now())
    assert (v.kind, v.reason) == ("reject", Reason.BAD_SIGNATURE)
    v = validate_frame(frame({**sync_body(repo, after), "rev": r.rev}, "#sync"), None, key, now())
    assert v.reason == Reason.COMMIT_REV_MISMATCH
    v = validate_frame(frame({**sync_body(repo, after), "blocks": r.car + b"\x00" * 10_000}, "#sync"), None, key, now())
    assert v.reason == Reason.BLOCKS_TOO_LARGE


def test_account_and_identity_messages() -> None:
    did = "did:plc:accountmsgs00000000000001"
    v = validate_frame(frame({"seq": 3, "did": did, "time": "2026-01-01T00:00:00Z", "active": False,
                              "status": "takendown"}, "#account"), None, None, now())
    assert v.kind == "accept" and v.new_state.upstream_status == "takendown" and not v.new_state.active
    v = validate_frame(frame({"seq": 4, "did": did, "time": "2026-01-01T00:00:00Z", "handle": "a.example.com"},
                             "#identity"), None, None, now())
    assert v.kind == "accept"
    v = validate_frame(frame({"seq": 4, "did": did, "time": "2026-01-01T00:00:00Z", "handle": "not a handle"},
                             "#identity"), None, None, now())
    assert v.reason == Reason.BAD_HANDLE


# --- fuzz ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_seed(chain):
    repo, before, r, _ = chain
    return frame(commit_body(repo, r)), before, repo.key.did_key()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_commit_frames_only_typed_verdicts(fuzz_seed, data: st.DataObject) -> None:
    raw, state, key = fuzz_seed
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(1, len(buf)))]
    v = validate_frame(bytes(buf), state, key, now())
    assert v.kind in ("accept", "ignore", "reject", "desync") and v.reason in ALL_REASONS


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_only_typed_rejections(data: bytes) -> None:
    v = validate_frame(data, None, "did:key:zQ3shULQPBZrbHpyf48oS68ZudUDQNdtWrhV8dafhaTFFUeGP", now())
    assert v.kind in ("reject", "ignore") and v.reason in ALL_REASONS


def test_state_cids_are_canonical_base32(chain) -> None:
    repo, before, r, _ = chain
    v = judge(commit_body(repo, r), before, repo.key.did_key())
    assert v.new_state.data_cid.startswith("bafyrei") and v.new_state.commit_cid == r.commit_cid.encode()


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20) | st.binary(max_size=40)
    | st.sampled_from([cid_for_cbor(b"\xa0"), EMPTY_TREE_ROOT]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_structured_field_mutations_only_typed_verdicts(chain, data: st.DataObject) -> None:
    repo, before, r, _ = chain
    body = commit_body(repo, r)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(body)))
        if data.draw(st.booleans()):
            body[key] = data.draw(_values)
        else:
            body.pop(key, None)
            if not body:
                break
    if body.get("ops") and isinstance(body["ops"], list) and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(body["ops"]) - 1))
        body["ops"][i] = data.draw(_values)
    state = data.draw(st.sampled_from([None, before]))
    v = validate_frame(frame(body), state, repo.key.did_key(), now())
    assert v.reason in ALL_REASONS
    if v.kind == "accept":  # only harmless fields (deprecated ones, seq, time) can have changed
        assert v.new_state.rev == r.rev
