"""Record → JSON text in the atproto data model's JSON form (``$link`` for CIDs, ``$bytes`` for
bytes, base64 without padding). Keys are sorted so equal records give equal text.

``record_json(obj)`` renders a decoded value; ``block_json(raw)`` decodes one record block
strictly (``mst.cbor.decode``: the same checks as everywhere else) and renders it. Both go through
the C JSON encoder, which calls back into Python only for CIDs and byte strings.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from mst.cbor import decode


def _special(obj: Any) -> dict[str, str]:
    """The JSON form of the two values JSON has no type for: bytes and CID links."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii").rstrip("=")}
    encode = getattr(obj, "encode", None)  # cbrrr.CID: base32 multibase string
    if callable(encode) and not isinstance(obj, str):
        return {"$link": encode()}
    raise TypeError(f"not a data-model value: {type(obj).__name__}")


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_special,
                            check_circular=False)  # decoded CBOR has no cycles


def _c_encode() -> Callable[[Any], str] | None:
    """The C encoder built once (``JSONEncoder.encode`` builds it again on every call, ~2 µs of a
    record's ~9); None where the C accelerator is missing. Same arguments as ``iterencode``
    passes it for this configuration."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    encode = make(None, _special, json.encoder.encode_basestring, None, ":", ",", True, False, True)

    def run(obj: Any) -> str:
        return "".join(encode(obj, 0))

    return run


_ENCODE: Callable[[Any], str] = _c_encode() or _ENCODER.encode


def record_json(obj: Any) -> str:
    """Canonical JSON text for a record."""
    return _ENCODE(obj)


def block_json(raw: bytes | memoryview) -> str:
    """Canonical JSON text of one record block (strict DAG-CBOR; raises ``CBORError``)."""
    return _ENCODE(decode(raw))
