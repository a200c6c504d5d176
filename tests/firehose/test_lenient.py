"""Lenient validation of sync 1.0 commits, in both modes: indigo's scenarios and their sync 1.0
variants (``scenario_cases``), and the I-D §4.5 checks that lenient mode keeps or gives up."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import cbrrr
import pytest

from firehose.reasons import Reason
from firehose.state import AccountState
from firehose.validate import Verdict, validate_frame
from mst.crypto import PrivateKey, parse_multibase_key
from mst.repo import Write

from .commits import commit_body, flip_sig, frame, new_repo, posts, rewrite_car, state_of
from .scenario_cases import CASE_NAMES, MODES, Case, cases


def _run(case: Case, lenient: bool) -> list[Verdict]:
    keys = {}
    for acct in case.accounts:
        k = acct["identity"]["keys"]["atproto"]
        keys[acct["identity"]["did"]] = parse_multibase_key(k["type"], k["publicKeyMultibase"]).did_key()
    states: dict[str, AccountState] = {}
    out = []
    for m in case.messages:
        hdr, body = m["frame"]["header"], m["frame"]["body"]
        raw = cbrrr.encode_dag_cbor(hdr, atjson_mode=True) + cbrrr.encode_dag_cbor(body, atjson_mode=True)
        did = body.get("did") or body.get("repo")
        v = validate_frame(raw, states.get(did), keys[did], time.time(), lenient=lenient)
        if v.new_state is not None:
            states[did] = v.new_state
        out.append(v)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_scenarios_in_both_modes(fixtures_dir: Path, name: str, mode: str) -> None:
    case = cases(fixtures_dir)[name]
    verdicts = _run(case, lenient=mode == "lenient")
    for i, v in enumerate(verdicts):
        assert (v.kind != "accept") == case.drop[mode][i], (name, mode, i, v)
        if v.kind == "accept" and case.reasons[mode][i] is not None:
            assert v.reason == case.reasons[mode][i], (name, mode, i, v)


def test_the_sync10_variants_differ_between_the_modes(fixtures_dir: Path) -> None:
    """The variants are not vacuous: strict drops what lenient accepts."""
    for name in ("sync10_no_prev_data", "legacy_delete_without_prev"):
        case = cases(fixtures_dir)[name]
        assert any(case.drop["strict"]) and not any(case.drop["lenient"])


# --- the I-D's commit checks, one commit at a time -------------------------------------------

@pytest.fixture(scope="module")
def chain():  # type: ignore[no-untyped-def]
    repo = new_repo("did:plc:lenientaccount00000000001")
    first = repo.apply_writes(posts(40))
    before = state_of(repo, first)
    r = repo.apply_writes([*posts(3, start=100, text="new"),
                           Write("update", "app.bsky.feed.post", "3k00000000001", {"text": "edited"}),
                           Write("delete", "app.bsky.feed.post", "3k00000000002")])
    after = repo.apply_writes(posts(1, start=200))
    return repo, before, r, after


def _no_prev_data(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "prevData"}


def _no_op_prev(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "ops": [{k: v for k, v in op.items() if k != "prev"} for op in body["ops"]]}


def _id_cases(chain) -> dict[str, tuple[dict[str, Any], AccountState | None, str, tuple[str, str], tuple[str, str]]]:  # type: ignore[no-untyped-def]
    """name -> (body, state, key, (strict verdict), (lenient verdict))."""
    repo, before, r, after = chain
    key = repo.key.did_key()
    good = commit_body(repo, r)
    bare = _no_prev_data(good)
    records = [op.cid for op in r.ops if op.cid is not None]
    missing = ("reject", Reason.MISSING_PREV_DATA)
    out = {
        # §4.5 with prevData: lenient mode judges exactly as strict mode
        "valid": (good, before, key, ("accept", "ok"), ("accept", "ok")),
        "dropped_op": ({**good, "ops": good["ops"][:-1]}, before, key,
                       ("reject", Reason.INVERSION_MISMATCH), ("reject", Reason.INVERSION_MISMATCH)),
        "prev_data_not_stored": (good, dataclasses.replace(before, data_cid=state_of(repo, after).data_cid), key,
                                 ("desync", Reason.PREV_DATA_MISMATCH), ("desync", Reason.PREV_DATA_MISMATCH)),
        # sync 1.0 commits (no prevData): every check but inversion still applies
        "sync10": (bare, before, key, missing, ("accept", Reason.LENIENT_NO_PREV_DATA)),
        "sync10_bad_signature": (_no_prev_data(flip_sig(good)), before, key,
                                 missing, ("reject", Reason.BAD_SIGNATURE)),
        "sync10_wrong_key": (bare, before, PrivateKey.generate_k256().did_key(),
                             missing, ("reject", Reason.BAD_SIGNATURE)),
        "sync10_corrupt_block": (rewrite_car(bare, corrupt=records[0]), before, key,
                                 ("reject", Reason.BAD_BLOCK_HASH), ("reject", Reason.BAD_BLOCK_HASH)),
        "sync10_missing_record": (rewrite_car(bare, drop={records[0]}), before, key,
                                  ("reject", Reason.MISSING_RECORD_BLOCK), ("reject", Reason.MISSING_RECORD_BLOCK)),
        "sync10_forged_op_cid": ({**bare, "ops": [{**bare["ops"][0], "cid": records[1]}, *bare["ops"][1:]]},
                                 before, key, missing, ("reject", Reason.OPS_NOT_IN_TREE)),
        "sync10_missing_tree_node": (rewrite_car(bare, drop={r.data}), before, key,
                                     missing, ("reject", Reason.MISSING_MST_BLOCK)),
        "sync10_since_skips_a_commit": (_no_prev_data(commit_body(repo, after)), before, key,
                                        missing, ("desync", Reason.SINCE_MISMATCH)),
        "sync10_old_commit": (bare, state_of(repo, after), key,
                              ("ignore", Reason.REV_NOT_INCREASING), ("ignore", Reason.REV_NOT_INCREASING)),
        # what lenient mode gives up: without prevData an incomplete op list cannot be detected
        "sync10_dropped_op": ({**bare, "ops": bare["ops"][:-1]}, before, key,
                              missing, ("accept", Reason.LENIENT_NO_PREV_DATA)),
        # legacy ops without prev (prevData present): no inversion, but the chain is still checked
        "no_op_prev": (_no_op_prev(good), before, key,
                       ("reject", Reason.INVERSION_INVALID_OP), ("accept", Reason.LENIENT_NO_OP_PREV)),
        "no_op_prev_prev_data_not_stored": (_no_op_prev(good),
                                            dataclasses.replace(before, data_cid=state_of(repo, after).data_cid), key,
                                            ("reject", Reason.INVERSION_INVALID_OP),
                                            ("desync", Reason.PREV_DATA_MISMATCH)),
    }
    return out


CHECKS = ("valid", "dropped_op", "prev_data_not_stored", "sync10", "sync10_bad_signature", "sync10_wrong_key",
          "sync10_corrupt_block", "sync10_missing_record", "sync10_forged_op_cid", "sync10_missing_tree_node",
          "sync10_since_skips_a_commit", "sync10_old_commit", "sync10_dropped_op", "no_op_prev",
          "no_op_prev_prev_data_not_stored")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CHECKS)
def test_commit_checks_in_both_modes(chain, name: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    body, state, key, strict, lenient = _id_cases(chain)[name]
    v = validate_frame(frame(body), state, key, time.time(), lenient=mode == "lenient")
    assert (v.kind, v.reason) == (strict if mode == "strict" else lenient)
    if v.kind == "accept":
        assert v.new_state is not None and v.new_state.rev == body["rev"] and v.new_state.sync_state == "synced"


def test_lenient_accept_keeps_the_chain(chain) -> None:  # type: ignore[no-untyped-def]
    """A sync 1.0 commit accepted leniently becomes the state the next commit chains to."""
    repo, before, r, after = chain
    key = repo.key.did_key()
    v = validate_frame(frame(_no_prev_data(commit_body(repo, r))), before, key, time.time(), lenient=True)
    assert v.kind == "accept" and v.new_state is not None
    assert v.new_state.data_cid == r.data.encode() and v.new_state.commit_cid == r.commit_cid.encode()
    nxt = validate_frame(frame(commit_body(repo, after)), v.new_state, key, time.time(), lenient=True)
    assert (nxt.kind, nxt.reason) == ("accept", "ok")
