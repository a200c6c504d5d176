"""The ``#identity``/``#account`` verdicts and what is passed on, decision by decision (each
branch here is a guard: the mutation run of ``./run mutate`` names the tests that kill it)."""

from __future__ import annotations

import dataclasses

from firehose.messages import AccountMessage, IdentityMessage
from firehose.reasons import Reason
from firehose.state import AccountState
from firehose.validate import Verdict, identity_body, validate_account, validate_frame, validate_identity
from mst import cbor
from mst.car import read_car, write_car
from mst.cid import CID, cid_for_cbor, cid_for_raw
from mst.errors import CBORError

from .commits import commit_body, frame, new_repo, posts, state_of

DID = "did:plc:verdicts0000000000000001"
T = "2026-01-01T00:00:00Z"


def test_identity_verdicts() -> None:
    msg = IdentityMessage(1, DID, T, "a.example.com")
    active = AccountState(did=DID, host="pds.example")
    taken = AccountState(did=DID, host="pds.example", local_status="takendown")
    deactivated = AccountState(did=DID, host="pds.example", upstream_status="deactivated")
    v = validate_identity(msg, active, from_account_pds=False)
    assert (v.kind, v.reason, v.new_state) == ("reject", Reason.WRONG_HOST.value, None)
    assert validate_identity(msg, None, from_account_pds=False).kind == "reject"
    v = validate_identity(msg, taken, from_account_pds=True)
    assert (v.kind, v.reason, v.detail) == ("ignore", Reason.ACCOUNT_INACTIVE.value, "takendown")
    v = validate_identity(msg, deactivated, from_account_pds=True)
    assert (v.kind, v.reason, v.detail) == ("ignore", Reason.ACCOUNT_INACTIVE.value, "deactivated")
    for state in (active, None):
        v = validate_identity(msg, state, from_account_pds=True)
        assert (v.kind, v.reason, v.new_state) == ("accept", Reason.OK.value, None)


def test_account_verdicts() -> None:
    state = AccountState(did=DID, host="pds.example", rev="3kaaaaaaaaaa2", local_status="takendown")
    v = validate_account(AccountMessage(1, DID, T, False, "suspended"), state, 5.0, from_account_pds=False)
    assert (v.kind, v.reason, v.new_state) == ("reject", Reason.WRONG_HOST.value, None)
    v = validate_account(AccountMessage(1, DID, T, False, "suspended"), state, 5.0)
    assert (v.kind, v.reason) == ("accept", Reason.OK.value)
    assert v.new_state == AccountState(did=DID, host="pds.example", rev="3kaaaaaaaaaa2", local_status="takendown",
                                       upstream_status="suspended", updated_at=5.0)
    v = validate_account(AccountMessage(1, DID, T, False, None), None, 6.0)
    assert v.new_state == AccountState(did=DID, upstream_status="deactivated", updated_at=6.0)
    v = validate_account(AccountMessage(1, DID, T, True, "suspended"), state, 7.0, from_account_pds=True)
    assert v.new_state is not None and v.new_state.upstream_status == "active"


def test_identity_body_keeps_lexicon_fields_and_a_verified_handle_only() -> None:
    body = {"seq": 9, "did": DID, "time": T, "handle": "a.example.com", "x": 1}
    assert identity_body(body, True) == {"did": DID, "time": T, "handle": "a.example.com"}
    assert identity_body(body, False) == {"did": DID, "time": T}
    assert identity_body({**body, "handle": ""}, True) == {"did": DID, "time": T}
    assert identity_body({**body, "handle": None}, True) == {"did": DID, "time": T}
    assert identity_body({**body, "handle": 5}, True) == {"did": DID, "time": T}


def test_sync_verdict_edges() -> None:
    """``#sync``: an inactive account's is ignored (exactly), and the 10,000-byte limit on its
    blocks is inclusive."""
    from firehose.messages import SyncMessage
    from firehose.validate import MAX_SYNC_BLOCKS_BYTES, validate_sync
    from mst import cbor
    from mst.car import read_car, write_car
    from mst.cid import cid_for_cbor

    from .commits import new_repo, posts, sync_body

    repo = new_repo()
    res = repo.apply_writes(posts(1))
    body = sync_body(repo, res)
    taken = AccountState(did=repo.did, local_status="takendown")
    msg = SyncMessage(1, repo.did, body["rev"], body["blocks"], T)
    v = validate_sync(msg, taken, repo.key.did_key(), 0.0)
    assert (v.kind, v.reason, v.new_state, v.detail) == ("ignore", Reason.ACCOUNT_INACTIVE.value, None, "takendown")
    car = read_car(body["blocks"])

    def padded_to(size: int) -> bytes:
        n = size - len(body["blocks"]) - 40
        while True:
            pad = cbor.encode({"p": b"x" * n})
            out = write_car(car.roots, [*car.blocks.items(), (cid_for_cbor(pad), pad)])
            if len(out) == size:
                return out
            n += size - len(out)

    import time

    at_limit = validate_sync(SyncMessage(1, repo.did, body["rev"], padded_to(MAX_SYNC_BLOCKS_BYTES), T), None,
                             repo.key.did_key(), time.time())
    assert at_limit.kind == "accept", at_limit
    over = validate_sync(SyncMessage(1, repo.did, body["rev"], padded_to(MAX_SYNC_BLOCKS_BYTES + 1), T), None,
                         repo.key.did_key(), time.time())
    assert (over.kind, over.reason, over.detail) == ("reject", Reason.BLOCKS_TOO_LARGE.value,
                                                     str(MAX_SYNC_BLOCKS_BYTES + 1))


def test_accepted_sync_state_and_reason() -> None:
    """An accepted ``#sync`` resets the account to its commit: ``ok`` when it matches the stored
    data (or nothing is stored), ``sync_reset`` when it does not; the state is exact."""
    from firehose.messages import SyncMessage
    from firehose.validate import cid_text, validate_sync

    from .commits import new_repo, posts, sync_body

    repo = new_repo()
    first = repo.apply_writes(posts(1))
    res = repo.apply_writes(posts(1, start=5))
    body = sync_body(repo, res)
    msg = SyncMessage(1, repo.did, body["rev"], body["blocks"], T)
    key = repo.key.did_key()
    expected = AccountState(did=repo.did, rev=res.rev, commit_cid=cid_text(res.commit_cid), data_cid=cid_text(res.data),
                            sync_state="synced", updated_at=2e9)
    v = validate_sync(msg, None, key, 2e9)
    assert (v.kind, v.reason, v.new_state) == ("accept", Reason.OK.value, expected)
    same = AccountState(did=repo.did, host="h", rev=first.rev, data_cid=cid_text(res.data), sync_state="desynchronized")
    v = validate_sync(msg, same, key, 2e9)
    assert (v.kind, v.reason) == ("accept", Reason.OK.value)
    assert v.new_state is not None and (v.new_state.host, v.new_state.sync_state) == ("h", "synced")
    other = AccountState(did=repo.did, rev=first.rev, data_cid=cid_text(first.data))
    v = validate_sync(msg, other, key, 2e9)
    assert (v.kind, v.reason) == ("accept", Reason.SYNC_RESET.value)


def test_commit_gate_verdicts_are_exact() -> None:
    """Step 0 of ``#commit``: an inactive account's commit is ignored (the detail names the status),
    and an account marked ``desynchronized`` *or* ``resyncing`` gets ``desync``/``resync_in_progress``
    (the lane buffers it) — nothing else about the commit is looked at, and no state comes back."""
    repo = new_repo()
    first = repo.apply_writes(posts(1))
    second = repo.apply_writes(posts(1, start=5))
    raw, key, base = frame(commit_body(repo, second)), repo.key.did_key(), state_of(repo, first)
    for status in ({"local_status": "takendown"}, {"upstream_status": "suspended"}):
        state = _with(base, **status)
        v = validate_frame(raw, state, key, 2e9)
        assert v == Verdict("ignore", Reason.ACCOUNT_INACTIVE.value, None, state.combined_status), v
    for sync_state in ("desynchronized", "resyncing"):
        v = validate_frame(raw, _with(base, sync_state=sync_state), key, 2e9)
        assert v == Verdict("desync", Reason.RESYNC_IN_PROGRESS.value, None, sync_state), v
    assert validate_frame(raw, base, key, 2e9).kind == "accept"  # the same commit, the gate open


def _with(state: AccountState, **changes: object) -> AccountState:
    return dataclasses.replace(state, **changes)


def test_record_blocks_must_be_dag_cbor_maps() -> None:
    """A created record must be under a dag-cbor CID and decode as one strict DAG-CBOR map: a raw
    CID, bytes that are not DAG-CBOR, and a DAG-CBOR list are each ``bad_record`` (the decoder's
    own reason is the detail when it refuses the bytes)."""
    repo = new_repo()
    res = repo.apply_writes(posts(2))
    good = commit_body(repo, res)
    car = read_car(good["blocks"])
    key = repo.key.did_key()
    assert validate_frame(frame(good), None, key, 2e9).kind == "accept"

    def with_record(cid: CID, block: bytes) -> dict:
        blocks = write_car(car.roots, [*car.blocks.items(), (cid, block)])
        op = {"action": "create", "path": "app.bsky.feed.post/3kzzzzzzzzzzz", "cid": cid}
        return {**good, "blocks": blocks, "ops": [op, *good["ops"]]}

    raw_block = cbor.encode({"text": "a map, but under a raw CID"})
    v = validate_frame(frame(with_record(cid_for_raw(raw_block), raw_block)), None, key, 2e9)
    assert (v.kind, v.reason, v.new_state) == ("reject", Reason.BAD_RECORD.value, None)
    not_cbor = b"\xa1\x61a\x01\x00"  # a map followed by a trailing byte
    try:
        cbor.decode(not_cbor)
        raise AssertionError("the decoder accepted trailing bytes")
    except CBORError as exc:
        decoder_reason = exc.reason
    v = validate_frame(frame(with_record(cid_for_cbor(not_cbor), not_cbor)), None, key, 2e9)
    assert (v.kind, v.reason, v.detail) == ("reject", Reason.BAD_RECORD.value, decoder_reason)
    a_list = cbor.encode([1, 2])
    v = validate_frame(frame(with_record(cid_for_cbor(a_list), a_list)), None, key, 2e9)
    assert (v.kind, v.reason) == ("reject", Reason.BAD_RECORD.value)


def test_validate_commit_is_strict_unless_told_lenient() -> None:
    """``validate_commit``'s default is strict: a later commit without ``prevData`` is rejected
    ``missing_prev_data``; only ``lenient=True`` accepts it (``lenient_no_prev_data``)."""
    from firehose.messages import CommitMessage, parse_message
    from firehose.validate import validate_commit

    repo = new_repo()
    first = repo.apply_writes(posts(1))
    second = repo.apply_writes(posts(1, start=5))
    body = {k: v for k, v in commit_body(repo, second).items() if k != "prevData"}
    msg = parse_message("#commit", body)
    assert isinstance(msg, CommitMessage) and msg.since is not None
    state, key = state_of(repo, first), repo.key.did_key()
    assert validate_commit(msg, state, key, 2e9).reason == Reason.MISSING_PREV_DATA.value
    assert validate_commit(msg, state, key, 2e9, lenient=True).reason == Reason.LENIENT_NO_PREV_DATA.value


def test_commit_blocks_limit_is_inclusive() -> None:
    """A ``#commit``'s ``blocks`` may be exactly 2,000,000 bytes; one more is ``blocks_too_large``
    (the detail gives the size)."""
    from firehose.validate import MAX_COMMIT_BLOCKS_BYTES, MAX_RECORD_BYTES

    repo = new_repo()
    res = repo.apply_writes(posts(1))
    good = commit_body(repo, res)
    car = read_car(good["blocks"])

    def padded_to(size: int) -> bytes:
        """The commit's CAR with two unreferenced blocks (each under the per-block limit) added."""
        n = (size - len(good["blocks"])) // 2 - 60
        extra = 0
        while True:
            pads = [cbor.encode({"p": bytes([i]) * (n + (extra if i else 0))}) for i in range(2)]
            assert all(len(p) < MAX_RECORD_BYTES for p in pads)
            out = write_car(car.roots, [*car.blocks.items(), *((cid_for_cbor(p), p) for p in pads)])
            if len(out) == size:
                return out
            extra += size - len(out)

    at_limit = validate_frame(frame({**good, "blocks": padded_to(MAX_COMMIT_BLOCKS_BYTES)}), None,
                              repo.key.did_key(), 2e9)
    assert (at_limit.kind, at_limit.reason) == ("accept", Reason.OK.value), at_limit
    over = validate_frame(frame({**good, "blocks": padded_to(MAX_COMMIT_BLOCKS_BYTES + 1)}), None,
                          repo.key.did_key(), 2e9)
    assert (over.kind, over.reason, over.detail) == ("reject", Reason.BLOCKS_TOO_LARGE.value,
                                                     str(MAX_COMMIT_BLOCKS_BYTES + 1))


def test_car_and_commit_block_verdicts() -> None:
    """The slice's framing: an unreadable CAR is ``bad_car`` (the reader's reason as detail), a root
    whose block is absent ``missing_commit_block``, a root block that is no commit ``bad_commit``
    (the commit decoder's reason as detail)."""
    from mst.commit import decode_commit
    from mst.errors import CARError, CommitError

    repo = new_repo()
    res = repo.apply_writes(posts(1))
    good = commit_body(repo, res)
    car = read_car(good["blocks"])
    key = repo.key.did_key()
    truncated = good["blocks"][:-3]
    try:
        read_car(truncated)
        raise AssertionError("a truncated CAR was read")
    except CARError as exc:
        car_reason = exc.reason
    v = validate_frame(frame({**good, "blocks": truncated}), None, key, 2e9)
    assert (v.kind, v.reason, v.detail) == ("reject", Reason.BAD_CAR.value, car_reason)
    without_commit = write_car(car.roots, [(c, b) for c, b in car.blocks.items() if c != res.commit_cid])
    v = validate_frame(frame({**good, "blocks": without_commit}), None, key, 2e9)
    assert (v.kind, v.reason, v.new_state) == ("reject", Reason.MISSING_COMMIT_BLOCK.value, None)
    not_a_commit = cbor.encode({"did": repo.did, "version": 3})
    other_root = cid_for_cbor(not_a_commit)
    try:
        decode_commit(not_a_commit)
        raise AssertionError("a map without the commit's fields decoded as a commit")
    except CommitError as exc:
        commit_reason = exc.reason
    blocks = write_car([other_root], [*car.blocks.items(), (other_root, not_a_commit)])
    v = validate_frame(frame({**good, "commit": other_root, "blocks": blocks}), None, key, 2e9)
    assert (v.kind, v.reason, v.detail) == ("reject", Reason.BAD_COMMIT.value, commit_reason)


def test_commit_states_are_exact() -> None:
    """The state a ``#commit`` verdict carries: for an account seen first, the commit's own (with
    the DID); ``synced`` whatever the stored sync state was; and the stored state marked
    ``desynchronized`` at ``now`` on either chain break."""
    from firehose.validate import cid_text

    repo = new_repo()
    first = repo.apply_writes(posts(1))
    second = repo.apply_writes(posts(1, start=5))
    key, base = repo.key.did_key(), state_of(repo, first)
    after = AccountState(did=repo.did, rev=second.rev, commit_cid=cid_text(second.commit_cid),
                         data_cid=cid_text(second.data), sync_state="synced", updated_at=2e9)
    v = validate_frame(frame(commit_body(repo, second)), None, key, 2e9)
    assert (v.kind, v.new_state) == ("accept", after)
    v = validate_frame(frame(commit_body(repo, second)), _with(base, sync_state="throttled", host="h"), key, 2e9)
    assert (v.kind, v.new_state) == ("accept", _with(after, host="h"))
    since_broken = _with(base, rev="2aaaaaaaaaaaa", host="h")  # older than `first`, so `since` differs
    v = validate_frame(frame(commit_body(repo, second)), since_broken, key, 2e9)
    assert (v.kind, v.reason) == ("desync", Reason.SINCE_MISMATCH.value)
    assert v.new_state == _with(since_broken, sync_state="desynchronized", updated_at=2e9)
    data_broken = _with(base, data_cid=cid_text(second.data), host="h")
    v = validate_frame(frame(commit_body(repo, second)), data_broken, key, 2e9)
    assert (v.kind, v.reason) == ("desync", Reason.PREV_DATA_MISMATCH.value)
    assert v.new_state == _with(data_broken, sync_state="desynchronized", updated_at=2e9)
