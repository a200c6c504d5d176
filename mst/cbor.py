"""Strict DAG-CBOR (the atproto data model's binary encoding).

Backend: ``cbrrr`` (C). Measured on this machine it rejected every malformed case we tried
(non-minimal integers/lengths, unsorted/duplicate/non-string map keys, indefinite lengths,
float16/32, NaN/±Inf, tags other than 42, tag 42 without the 0x00 prefix, simple/undefined
values, truncation, invalid UTF-8). ``libipld`` is faster but accepts non-minimal integers and
float32 and decodes CIDs to plain bytes, so it is not used. On top of cbrrr this module adds:

* trailing-bytes rejection for :func:`decode` (:func:`decode_prefix` returns the offset instead),
* CID links must be the blessed form (CIDv1, dag-cbor/raw, sha-256/32) — see ``mst.cid``,
* integers must fit a signed 64-bit integer (the atproto data model's ``integer``),
* containers may nest at most ``MAX_DEPTH`` (256) deep, so consumers can recurse safely,
* every failure becomes :class:`mst.errors.CBORError` with a fixed ``reason``.

Decoded values are plain Python: dict/list/str/int/bytes/bool/None/float/``CID``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cbrrr
from cbrrr import CID
from cbrrr import _cbrrr as _c

from mst.errors import CBORError

__all__ = ["CBOR_REASONS", "decode", "decode_prefix", "encode", "encode_head"]

CBOR_REASONS = frozenset(
    {
        "cbor_truncated",
        "cbor_non_minimal",
        "cbor_map_key_order",
        "cbor_unexpected_type",
        "cbor_indefinite_length",
        "cbor_invalid_header",
        "cbor_float_not_float64",
        "cbor_simple_value",
        "cbor_nan_or_infinity",
        "cbor_invalid_tag",
        "cbor_invalid_cid",
        "cbor_trailing_bytes",
        "cbor_invalid_utf8",
        "cbor_integer_out_of_range",
        "cbor_too_deep",
        "cbor_malformed",
        "cbor_unencodable",
    }
)

_DAG_PFX = b"\x01\x71\x12\x20"
_RAW_PFX = b"\x01\x55\x12\x20"
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
MAX_DEPTH = 256  # containers nested deeper than this are rejected (cbor_too_deep)


class _BadCID(ValueError):
    pass


def _strict_cid(raw: bytes) -> CID:
    if len(raw) == 36 and (raw[:4] == _DAG_PFX or raw[:4] == _RAW_PFX):
        return CID(bytes(raw))
    raise _BadCID("CID link is not CIDv1 dag-cbor/raw sha-256")


def _classify(exc: BaseException) -> str:
    if isinstance(exc, _BadCID):
        return "cbor_invalid_cid"
    if isinstance(exc, UnicodeDecodeError):
        return "cbor_invalid_utf8"
    if isinstance(exc, RecursionError):
        return "cbor_too_deep"
    msg = str(exc)
    if "not enough bytes" in msg:
        return "cbor_truncated"
    if "minimally" in msg:
        return "cbor_non_minimal"
    if "map key ordering" in msg:
        return "cbor_map_key_order"
    if "unexpected type" in msg:
        return "cbor_unexpected_type"
    if "for float mtype (25)" in msg or "for float mtype (26)" in msg:
        return "cbor_float_not_float64"
    if "for float mtype" in msg:
        return "cbor_simple_value"
    if "extra info (31)" in msg:
        return "cbor_indefinite_length"
    if "extra info" in msg:
        return "cbor_invalid_header"
    if "NaN" in msg or "Infinit" in msg:
        return "cbor_nan_or_infinity"
    if "tag" in msg:
        return "cbor_invalid_tag"
    if "CID" in msg:
        return "cbor_invalid_cid"
    return "cbor_malformed"


def _check_values(obj: Any) -> None:
    """Walk containers iteratively: nesting depth <= MAX_DEPTH and every int fits int64
    (cost ~ number of values, not bytes)."""
    stack = [(obj, 1)]
    pop = stack.pop
    push = stack.append
    while stack:
        o, depth = pop()
        if depth > MAX_DEPTH:
            raise CBORError("cbor_too_deep", f"nesting deeper than {MAX_DEPTH}")
        for c in o.values() if type(o) is dict else o:
            t = type(c)
            if t is dict or t is list:
                push((c, depth + 1))
            elif t is int and (c > _INT64_MAX or c < _INT64_MIN):
                raise CBORError("cbor_integer_out_of_range", "integer does not fit in int64")


def _no_fast_check(obj: object) -> bool:
    return False


def decode_prefix(data: bytes | bytearray | memoryview) -> tuple[object, int]:
    """Decode one strict DAG-CBOR object from the start of ``data``.

    Returns ``(object, bytes_consumed)``; bytes after the object are left to the caller (used for
    firehose frames, which are two concatenated objects). Raises ``CBORError``.
    """
    try:
        obj, n = _c.decode_dag_cbor(data, _cid_ctor, False)  # type: ignore[arg-type]  # any buffer
    except CBORError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError, cbrrr.CbrrrDecodeError) as exc:
        raise CBORError(_classify(exc), str(exc)[:200]) from None
    t = type(obj)
    if (t is dict or t is list) and not _values_ok(obj):
        _check_values(obj)
    elif t is int and (obj > _INT64_MAX or obj < _INT64_MIN):
        raise CBORError("cbor_integer_out_of_range", "integer does not fit in int64")
    return obj, n


def decode(data: bytes | bytearray | memoryview) -> object:
    """Decode exactly one strict DAG-CBOR object occupying all of ``data``; raises ``CBORError``."""
    obj, n = decode_prefix(data)
    if n != len(data):
        raise CBORError("cbor_trailing_bytes", f"{len(data) - n} bytes after the object")
    return obj


def encode(obj: object) -> bytes:
    """Canonical DAG-CBOR encoding (map keys sorted length-first, minimal integers).

    Raises ``CBORError('cbor_unencodable')`` for values outside the data model (non-string map
    keys, sets, NaN/±Inf, integers outside int64, other Python types).
    """
    try:
        out = _c.encode_dag_cbor(obj, CID, False)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise CBORError("cbor_unencodable", str(exc)[:200]) from None
    t = type(obj)
    if (t is dict or t is list) and not _values_ok(obj):
        _check_values(obj)
    elif t is int and (obj > _INT64_MAX or obj < _INT64_MIN):  # type: ignore[operator]
        raise CBORError("cbor_integer_out_of_range", "integer does not fit in int64")
    return out


def decode_schema_checked(data: bytes | bytearray | memoryview) -> object:
    """:func:`decode` for fixed schemas whose caller checks every integer's range and every
    CID's form itself (MST nodes, commits): no int64 walk, CIDs are not checked here.
    The CBOR itself is exactly as strict as :func:`decode`."""
    try:
        obj, n = _c.decode_dag_cbor(data, CID, False)  # type: ignore[arg-type]  # any buffer
    except (ValueError, TypeError, RecursionError, OverflowError, cbrrr.CbrrrDecodeError) as exc:
        raise CBORError(_classify(exc), str(exc)[:200]) from None
    if n != len(data):
        raise CBORError("cbor_trailing_bytes", f"{len(data) - n} bytes after the object")
    return obj


def encode_trusted(obj: object) -> bytes:
    """:func:`encode` for values built by this package (no int64 range walk)."""
    try:
        return _c.encode_dag_cbor(obj, CID, False)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise CBORError("cbor_unencodable", str(exc)[:200]) from None


def encode_head(major: int, value: int) -> bytes:
    """The minimal-length (canonical) head of a CBOR item: ``major`` type 0–7 (unshifted: 0 uint,
    2 bytes, 3 text, 4 array, 5 map) and its argument ``value`` (the integer, a length or an
    entry count, 0 <= value < 2**64). The one head encoder for code that writes DAG-CBOR bytes
    directly (``mst.node.encode_node``, ``firehose.framing``)."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x10000:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


# The native path (mst._accel, when mst.native.ACCEL): a C constructor for the strict CIDs (it
# makes the blessed ones itself and hands anything else to ``_strict_cid``), and a C pass that
# accepts values ``_check_values`` would accept (False: ``_check_values`` runs and decides).
_cid_ctor: Callable[[bytes], CID] = _strict_cid
_values_ok: Callable[[object], bool] = _no_fast_check
# (At the end of the module: mst.native imports the compiled modules, which import this one.)
from mst.native import ACCEL  # noqa: E402

if ACCEL:
    from mst.accel import module as _accel_module

    _accel = _accel_module()
    _accel.init_cbor(_strict_cid)
    _cid_ctor = _accel.strict_cid
    _values_ok = _accel.values_ok
