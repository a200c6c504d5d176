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
