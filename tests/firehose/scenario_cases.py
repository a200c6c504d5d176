"""indigo's relay scenarios (``../shared/fixtures/indigo-relay-scenarios``) and their sync 1.0
variants, with what each validation mode must do with every message.

A scenario file records what indigo's relay does in one mode: its ``lenient`` flag names the
mode, each message's ``drop`` flag (with ``invalid``) the outcome. ``cases()`` gives, per scenario,
the expected drop flags in *both* modes:

* the recorded scenarios carry ``prevData`` and every op's ``prev``, so lenient mode has nothing
  to relax and expects exactly the recorded flags (checked: ``_fully_sync_11``);
* ``sync10_no_prev_data``: the same commits as a sync 1.0 host sends them (no ``prevData``). Strict:
  every commit is rejected ``missing_prev_data``. Lenient: all accepted (``lenient_no_prev_data``);
* ``legacy_delete_without_prev``: delete ops without ``prev``. Strict: the first such commit is
  rejected (inversion needs ``prev``) and every later commit no longer chains (``since``) — the
  account is desynchronized, so all of them are dropped. Lenient: all accepted, the deletes as
  ``lenient_no_op_prev``;
* ``chain_gap``: the stream misses one commit (as in indigo's ``deactivation`` and
  ``post_lifecycle_legacy`` scenarios, recorded in lenient mode), so the next one does not chain
  and the account is desynchronized; the upstream answers getRepo with 404, so its resync keeps
  failing. Strict: that commit and every later one are held for the ``#sync`` that never comes
  (dropped). Lenient, as Bluesky's Go relay: each still verifies (signature; inversion against its
  own ``prevData``), so all pass, with ``ok``;
* ``sync10_chain_gap``: the same gap in sync 1.0 commits (no ``prevData``). Strict: all rejected
  ``missing_prev_data``. Lenient: all pass as ``lenient_no_prev_data``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("strict", "lenient")


@dataclass(frozen=True)
class Case:
    name: str
    accounts: list[dict[str, Any]]
    #: message dicts as in the scenario files (``frame.header``, ``frame.body`` in atproto JSON)
    messages: list[dict[str, Any]]
    #: mode -> per-message "not redistributed" flag
    drop: dict[str, list[bool]]
    #: mode -> per-message accept reason expected for the messages not dropped (None: not checked)
    reasons: dict[str, list[str | None]]


def load(fixtures_dir: Path, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((fixtures_dir / "indigo-relay-scenarios" / f"{name}.json").read_text())
    return doc


def _fully_sync_11(messages: list[dict[str, Any]]) -> bool:
    for m in messages:
        body = m["frame"]["body"]
        if m["frame"]["header"]["t"] != "#commit":
            continue
        if "prevData" not in body or any(op["action"] != "create" and "prev" not in op for op in body["ops"]):
            return False
    return True


def recorded(fixtures_dir: Path, name: str) -> Case:
    """A scenario file as recorded. One recorded in strict mode must be all sync 1.1 (lenient mode
    then has nothing to relax and expects the same). One recorded in lenient mode (indigo's
    ``deactivation``, ``legacy``, ``post_lifecycle_legacy``, ``seq_ordering``: sync 1.0 commits,
    gaps in the chain) is what lenient mode expects; strict mode rejects every commit without
    ``prevData`` (``missing_prev_data``) and expects the recorded flags for the rest (only sync
    1.0 commits may appear in such a file: checked)."""
    doc = load(fixtures_dir, name)
    messages = doc["messages"]
    flags = [bool(m["drop"] or m["invalid"]) for m in messages]
    ok: list[str | None] = [None if f else "ok" for f in flags]
    if not doc.get("lenient"):
        assert _fully_sync_11(messages), "a strict scenario lacks prevData/prev: derive its other mode by hand"
        return Case(name, doc["accounts"], messages, {mode: flags for mode in MODES}, {mode: ok for mode in MODES})
    commits = set(_commits(messages))
    assert all("prevData" not in messages[i]["frame"]["body"] for i in commits), "mixed sync 1.0/1.1 scenario"
    strict = [f or i in commits for i, f in enumerate(flags)]
    lenient: list[str | None] = [None if f else "lenient_no_prev_data" if i in commits else "ok"
                                 for i, f in enumerate(flags)]
    return Case(name, doc["accounts"], messages, {"strict": strict, "lenient": flags},
                {"strict": [None if f else "ok" for f in strict], "lenient": lenient})


def _commits(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["frame"]["header"]["t"] == "#commit"]


def sync10_no_prev_data(fixtures_dir: Path) -> Case:
    doc = load(fixtures_dir, "post_lifecycle")
    messages = copy.deepcopy(doc["messages"])
    for i in _commits(messages):
        messages[i]["frame"]["body"].pop("prevData")
    n = len(messages)
    return Case("sync10_no_prev_data", doc["accounts"], messages,
                {"strict": [True] * n, "lenient": [False] * n},
                {"strict": [None] * n, "lenient": ["lenient_no_prev_data"] * n})


def legacy_delete_without_prev(fixtures_dir: Path) -> Case:
    doc = load(fixtures_dir, "post_lifecycle")
    messages = copy.deepcopy(doc["messages"])
    first: int | None = None
    reasons: list[str | None] = []
    for i, m in enumerate(messages):
        ops = m["frame"]["body"]["ops"]
        deletes = [op for op in ops if op["action"] == "delete"]
        for op in deletes:
            op.pop("prev")
        if deletes and first is None:
            first = i
        reasons.append("lenient_no_op_prev" if deletes else "ok")
    assert first is not None and first > 0
    n = len(messages)
    return Case("legacy_delete_without_prev", doc["accounts"], messages,
                {"strict": [i >= first for i in range(n)], "lenient": [False] * n},
                {"strict": ["ok" if i < first else None for i in range(n)], "lenient": reasons})


def _with_gap(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``messages`` without their third commit; returns them and the index of the first commit
    that no longer chains."""
    gap = _commits(messages)[2]
    return messages[:gap] + messages[gap + 1:], gap


def chain_gap(fixtures_dir: Path) -> Case:
    doc = load(fixtures_dir, "post_lifecycle")
    messages, broken = _with_gap(copy.deepcopy(doc["messages"]))
    n = len(messages)
    return Case("chain_gap", doc["accounts"], messages,
                {"strict": [i >= broken for i in range(n)], "lenient": [False] * n},
                {"strict": ["ok" if i < broken else None for i in range(n)], "lenient": ["ok"] * n})


def sync10_chain_gap(fixtures_dir: Path) -> Case:
    doc = load(fixtures_dir, "post_lifecycle")
    messages, _ = _with_gap(copy.deepcopy(doc["messages"]))
    for i in _commits(messages):
        messages[i]["frame"]["body"].pop("prevData")
    n = len(messages)
    return Case("sync10_chain_gap", doc["accounts"], messages,
                {"strict": [True] * n, "lenient": [False] * n},
                {"strict": [None] * n, "lenient": ["lenient_no_prev_data"] * n})


def cases(fixtures_dir: Path) -> dict[str, Case]:
    out = {name: recorded(fixtures_dir, name) for name in ("account_lifecycle", "post_lifecycle")}
    for build in (sync10_no_prev_data, legacy_delete_without_prev, chain_gap, sync10_chain_gap):
        case = build(fixtures_dir)
        out[case.name] = case
    return out


#: cases the validator alone decides (``tests.firehose.test_lenient``) and a relay too
CASE_NAMES = ("account_lifecycle", "post_lifecycle", "sync10_no_prev_data", "legacy_delete_without_prev")
#: cases a relay must get right (``tests.relay.test_e2e_scenarios``): the chain gaps' lenient verdicts
#: are the account lane's (a desynchronized account's commits pass as they verify), not the validator's
RELAY_CASE_NAMES = (*CASE_NAMES, "chain_gap", "sync10_chain_gap")
