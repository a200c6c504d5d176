"""Adapter between ingest and the firehose package's pure validation.

``judge(kind, body, state, signing_key)`` returns a ``Judgement(kind, reason, new_state)`` where
``kind`` is ``accept | ignore | reject | desync`` and ``reason`` is a snake_case label from
``firehose.reasons``. The protocol logic itself lives in ``firehose.validate``; this module only
parses the message model and maps the verdict, so that ingest never depends on its internals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from backfill.types import AccountState


@dataclass(slots=True)
class Judgement:
    kind: str
    reason: str
    new_state: AccountState | None = None


def judge(kind: str, body: dict[str, Any], state: AccountState | None, signing_key: str) -> Judgement:
    """Judge one ``#commit``/``#sync`` body against the stored state (pure; no I/O)."""
    from firehose import validate

    now = time.time()
    try:
        if kind == "#commit":
            verdict = validate.validate_commit(body, state, signing_key, now)
        else:
            verdict = validate.validate_sync(body, state, signing_key, now)
    except Exception as exc:  # validation must never crash ingest; keep its typed reason
        return Judgement("reject", str(getattr(exc, "reason", "validation_error")))
    return Judgement(str(verdict.kind), str(verdict.reason), verdict.new_state)
