"""Event-stream frame codec: ``header ++ payload``, both canonical DAG-CBOR.

Wire rules (I-D §4.2, event-stream spec):

* header ``{op: 1, t: "#type"}`` for messages, ``{op: -1}`` for errors (payload
  ``{error, message?}``; the sender closes the connection after it);
* a frame is at most :data:`MAX_FRAME_BYTES` (5 MB) including header and overhead;
* unknown ``op`` or ``t`` values are *ignored* by receivers (not errors), unknown fields are
  tolerated; malformed CBOR or a non-map header/payload is a hard :class:`FrameError`.

Our own frames are canonical DAG-CBOR. ``encode_frame`` copies a ``bytes`` field (the CAR slice)
verbatim into the output, so re-sequencing an event never re-encodes its ``blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cbrrr
from cbrrr import _cbrrr

from firehose.framing import frame_header
from firehose.reasons import Reason
from mst.cbor import decode_prefix
from mst.errors import CBORError, ReasonError

MAX_FRAME_BYTES = 5_000_000
OP_MESSAGE = 1
OP_ERROR = -1
#: Message types this package understands (the subscribeRepos union).
KNOWN_TYPES = frozenset({"#commit", "#sync", "#identity", "#account", "#info"})


class FrameError(ReasonError):
    """A frame that cannot be decoded. ``reason`` is a :class:`Reason` value."""


@dataclass(slots=True, frozen=True)
class Frame:
    """A decoded frame. ``t`` is None for error frames; ``body`` is always a dict."""

    op: int
    t: str | None
    body: dict[str, Any]

    @property
    def is_error(self) -> bool:
        return self.op == OP_ERROR

    @property
    def ignored_reason(self) -> str | None:
        """``unknown_op``/``unknown_type`` when receivers must skip this frame, else None."""
        if self.op not in (OP_MESSAGE, OP_ERROR):
            return Reason.UNKNOWN_OP.value
        if self.op == OP_MESSAGE and self.t not in KNOWN_TYPES:
            return Reason.UNKNOWN_TYPE.value
        return None

    @property
    def error(self) -> str | None:
        """For error frames, the error name (e.g. ``FutureCursor``)."""
        return self.body.get("error") if self.is_error else None


def encode_frame(t: str, body: dict[str, Any]) -> bytes:
    """Encode a message frame: DAG-CBOR header ``{op: 1, t}`` followed by the DAG-CBOR body."""
    return frame_header(t) + cbrrr.encode_dag_cbor(body)


def encode_error_frame(error: str, message: str | None = None) -> bytes:
    """Encode an error frame (``op: -1``); the caller closes the connection after sending it."""
    body: dict[str, Any] = {"error": error}
    if message is not None:
        body["message"] = message
    return cbrrr.encode_dag_cbor({"op": OP_ERROR}) + cbrrr.encode_dag_cbor(body)


def encode_info_frame(name: str, message: str | None = None) -> bytes:
    """Encode an ``#info`` message (not persisted, carries no ``seq``)."""
    body: dict[str, Any] = {"name": name}
    if message is not None:
        body["message"] = message
    return encode_frame("#info", body)


def _decode_one(view: memoryview, reason: Reason, strict: bool) -> tuple[Any, int]:
    if strict:
        try:
            return decode_prefix(view)
        except CBORError as exc:
            raise FrameError(reason, exc.reason) from None
    try:
        return _cbrrr.decode_dag_cbor(view, cbrrr.CID, False)  # type: ignore[arg-type]  # any buffer
    except Exception as exc:  # cbrrr raises CbrrrDecodeError, ValueError, EOFError, ...
        raise FrameError(reason, type(exc).__name__) from None


def decode_frame(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES, strict: bool = True) -> Frame:
    """Decode one binary WebSocket frame into a :class:`Frame`.

    Raises :class:`FrameError` for oversize, malformed CBOR, non-map header/payload, a missing
    or non-integer ``op``, a missing ``t`` on ``op: 1``, an error frame without ``error``, or
    bytes after the payload. Unknown ``op``/``t`` decode fine; see :attr:`Frame.ignored_reason`.

    ``strict`` (default) applies the repository core's full DRISL rules (blessed CIDs only,
    int64 range) via ``mst.cbor``; ``strict=False`` is cbrrr's DAG-CBOR decoder alone (still
    canonical-only, ~3x faster), for a process that only routes frames to a validator that
    decodes strictly again (the upstream subscriber).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FrameError(Reason.BAD_HEADER_CBOR, "not binary")
    size = len(data)
    if size == 0:
        raise FrameError(Reason.FRAME_EMPTY)
    if size > max_bytes:
        raise FrameError(Reason.FRAME_TOO_LARGE, f"{size} bytes")
    view = memoryview(data)
    header, used = _decode_one(view, Reason.BAD_HEADER_CBOR, strict)
    if not isinstance(header, dict):
        raise FrameError(Reason.HEADER_NOT_MAP)
    op = header.get("op")
    if type(op) is not int:
        raise FrameError(Reason.BAD_HEADER_OP)
    t = header.get("t")
    if op == OP_MESSAGE and not isinstance(t, str):
        raise FrameError(Reason.MISSING_HEADER_TYPE)
    if used >= size:
        raise FrameError(Reason.BAD_BODY_CBOR, "no payload")
    body, used2 = _decode_one(view[used:], Reason.BAD_BODY_CBOR, strict)
    if used + used2 != size:
        raise FrameError(Reason.TRAILING_BYTES)
    if not isinstance(body, dict):
        raise FrameError(Reason.BODY_NOT_MAP)
    if op == OP_ERROR:
        if not isinstance(body.get("error"), str):
            raise FrameError(Reason.MISSING_FIELD, "error")
        t = None
    return Frame(op=op, t=t if isinstance(t, str) else None, body=body)
