"""The atproto data model: JSON <-> DAG-CBOR value conversion and record-level checks.

JSON form uses ``{"$link": "<cid>"}`` for CID links and ``{"$bytes": "<base64>"}`` for bytes.
Floats are not part of the data model; integer-valued JSON numbers (``123.0``) are integers.
Errors are :class:`mst.errors.DataModelError` with reasons ``not_an_object``, ``float_not_allowed``,
``invalid_type_field``, ``invalid_blob``, ``invalid_bytes``, ``invalid_link``, ``unsupported_value``.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from mst.cid import CID, parse_cid
from mst.errors import CIDError, DataModelError

__all__ = ["data_to_json", "json_to_data", "validate_data"]

_B64_RE = re.compile(r"[A-Za-z0-9+/]*")
_MAX_DEPTH = 128


def _b64decode(s: str) -> bytes:
    if not _B64_RE.fullmatch(s) or len(s) % 4 == 1:
        raise DataModelError("invalid_bytes", "$bytes must be unpadded standard base64")
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise DataModelError("invalid_bytes", "bad base64") from None


def _check_typed(obj: dict[str, Any]) -> None:
    t = obj["$type"]
    if not isinstance(t, str) or not t:
        raise DataModelError("invalid_type_field", "$type must be a non-empty string")
    if t == "blob":
        ref, mime, size = obj.get("ref"), obj.get("mimeType"), obj.get("size")
        if not isinstance(ref, CID) or not isinstance(mime, str) or type(size) is not int:
            raise DataModelError("invalid_blob", "blob needs ref (link), mimeType, size (int)")


def _from_json(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise DataModelError("unsupported_value", "nesting too deep")
    t = type(v)
    if t is str or t is int or t is bool or v is None:
        return v
    if t is float:
        if v.is_integer():
            return int(v)
        raise DataModelError("float_not_allowed", "floats are not allowed")
    if t is list:
        return [_from_json(x, depth + 1) for x in v]
    if t is dict:
        if "$link" in v:
            link = v["$link"]
            if len(v) != 1 or not isinstance(link, str):
                raise DataModelError("invalid_link", "$link object must be {'$link': str}")
            try:
                return parse_cid(link)
            except CIDError as exc:
                raise DataModelError("invalid_link", exc.reason) from None
        if "$bytes" in v:
            b = v["$bytes"]
            if len(v) != 1 or not isinstance(b, str):
                raise DataModelError("invalid_bytes", "$bytes object must be {'$bytes': str}")
            return _b64decode(b)
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise DataModelError("unsupported_value", "object keys must be strings")
            out[k] = _from_json(x, depth + 1)
        if "$type" in out:
            _check_typed(out)
        return out
    raise DataModelError("unsupported_value", f"unsupported JSON value {t.__name__}")


def json_to_data(v: Any) -> dict[str, Any]:
    """Convert parsed atproto JSON (a top-level object) to data-model values; raises."""
    if not isinstance(v, dict):
        raise DataModelError("not_an_object", "top-level value must be an object")
    out: dict[str, Any] = _from_json(v, 0)  # an object converts to an object
    return out


def data_to_json(v: Any) -> Any:
    """Convert data-model values (as decoded from DAG-CBOR) to the atproto JSON form."""
    if isinstance(v, CID):
        return {"$link": v.encode()}
    if isinstance(v, bytes):
        return {"$bytes": base64.b64encode(v).decode().rstrip("=")}
    if isinstance(v, list):
        return [data_to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: data_to_json(x) for k, x in v.items()}
    return v


def validate_data(v: Any, depth: int = 0) -> None:
    """Check a decoded value against the atproto data model (no floats, valid ``$type`` and
    blobs, top-level object); raises ``DataModelError``."""
    if depth == 0 and not isinstance(v, dict):
        raise DataModelError("not_an_object", "top-level value must be an object")
    if depth > _MAX_DEPTH:
        raise DataModelError("unsupported_value", "nesting too deep")
    t = type(v)
    if t is float:
        raise DataModelError("float_not_allowed", "floats are not allowed")
    if t is list:
        for x in v:
            validate_data(x, depth + 1)
    elif t is dict:
        for x in v.values():
            validate_data(x, depth + 1)
        if "$type" in v:
            _check_typed(v)
