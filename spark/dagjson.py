"""Record → JSON text in the atproto data model's JSON form (``$link`` for CIDs, ``$bytes`` for
bytes, base64 without padding). Keys are sorted so equal records give equal text."""

from __future__ import annotations

import base64
import json
from typing import Any


def to_json_value(obj: Any) -> Any:
    """Convert a decoded DAG-CBOR value to plain JSON-compatible Python."""
    if isinstance(obj, dict):
        return {str(k): to_json_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json_value(v) for v in obj]
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii").rstrip("=")}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    encode = getattr(obj, "encode", None)  # cbrrr.CID: base32 multibase string
    if callable(encode):
        return {"$link": encode()}
    raise TypeError(f"not a data-model value: {type(obj).__name__}")


def record_json(obj: Any) -> str:
    """Canonical JSON text for a record."""
    return json.dumps(to_json_value(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
