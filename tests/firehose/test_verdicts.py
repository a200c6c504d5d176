"""The ``#identity``/``#account`` verdicts and what is passed on, decision by decision (each
branch here is a guard: the mutation run of ``./run mutate`` names the tests that kill it)."""

from __future__ import annotations

from firehose.messages import AccountMessage, IdentityMessage
from firehose.reasons import Reason
from firehose.state import AccountState
from firehose.validate import identity_body, validate_account, validate_identity

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
