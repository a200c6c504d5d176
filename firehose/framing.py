"""Byte-level framing for the sequencer: put ``seq`` into a body that is already encoded.

A producer (e.g. a validation worker, in another process) can hand the sequencer a message body
as canonical DAG-CBOR *without* ``seq`` (``PendingEvent.body_cbor``), ideally with the byte offset
where ``seq`` belongs (``PendingEvent.seq_offset``, from ``encode_unsequenced``); the sequencer
then only inserts the ``"seq": n`` entry — no re-encoding of the 2–4 KB body in the
single-writer process.

Canonical DAG-CBOR map keys are text strings sorted length-first, then bytewise, so ``seq`` goes
after the keys shorter than three bytes and the three-byte keys below ``b"seq"`` (``ops``,
``rev``, ``did``). Without an offset, ``splice_seq`` finds the spot by walking only those
top-level entries (strings and scalars by their head; nested values such as ``ops`` by cbrrr's
C decoder with CIDs left as plain bytes), then inserts ``63 73 65 71 <uint>`` and rewrites the
map header's entry count. The result is byte-for-byte what encoding the body dict with ``seq``
added gives (tested against ``cbrrr`` with hypothesis).

``frame_header`` is the DAG-CBOR header ``{op: 1, t}``, so ``splice_seq(body, n,
frame_header(t))`` is the frame ``firehose.frames.encode_frame(t, {**body, "seq": n})`` would
produce.

Contract: the input must be one complete canonical DAG-CBOR map with text keys (as produced by
``cbrrr.encode_dag_cbor`` or accepted by a canonical decoder). Malformed input raises
``FramingError`` with a snake_case ``reason`` (``body_not_map``, ``truncated_body``,
``seq_present``, ``bad_seq``, ``bad_offset``); nothing beyond the walked keys is validated.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import cbrrr
from cbrrr import _cbrrr

from mst.cbor import encode_head
from mst.errors import ReasonError

__all__ = [
    "FramingError",
    "encode_unsequenced",
    "frame_header",
    "seq_offset",
    "splice_seq",
]

_SEQ_KEY = b"\x63seq"  # text(3) "seq"
_SEQ_LIMIT = 2**53


class FramingError(ReasonError, ValueError):
    """A pre-encoded body the splicer cannot handle; ``reason`` is snake_case."""


@lru_cache(maxsize=64)
def frame_header(t: str) -> bytes:
    """The DAG-CBOR frame header ``{op: 1, t: t}`` (also ``firehose.frames.encode_frame``'s)."""
    return cbrrr.encode_dag_cbor({"op": 1, "t": t})


def _arg(buf: bytes | memoryview, pos: int) -> tuple[int, int, int]:
    """Read the head at ``pos``: ``(major, argument, position after the head)``."""
    ib = buf[pos]
    info = ib & 31
    if info < 24:
        return ib >> 5, info, pos + 1
    if info == 24:
        return ib >> 5, buf[pos + 1], pos + 2
    if info == 25:
        return ib >> 5, int.from_bytes(buf[pos + 1 : pos + 3], "big"), pos + 3
    if info == 26:
        return ib >> 5, int.from_bytes(buf[pos + 1 : pos + 5], "big"), pos + 5
    if info == 27:
        return ib >> 5, int.from_bytes(buf[pos + 1 : pos + 9], "big"), pos + 9
    raise FramingError("body_not_map", f"indefinite or reserved length at byte {pos}")


def _map_entries(body: bytes | memoryview) -> tuple[int, int]:
    """``(entry count, position of the first key)`` of the map ``body``."""
    if not body:
        raise FramingError("truncated_body", "empty")
    if body[0] >> 5 != 5:
        raise FramingError("body_not_map", f"major type {body[0] >> 5}")
    _, count, pos = _arg(body, 0)
    return count, pos


def _skip_value(view: memoryview, pos: int) -> int:
    """Position after the value item at ``pos``: strings and scalars by their head, nested
    items (the ``ops`` array, CIDs) by cbrrr's C decoder with a trivial CID constructor."""
    ib = view[pos]
    major = ib >> 5
    info = ib & 31
    if major == 2 or major == 3:
        if info < 24:
            return pos + 1 + info
        _, arg, after = _arg(view, pos)
        return after + arg
    if major <= 1 or major == 7:
        return _arg(view, pos)[2]
    try:
        _, n = _cbrrr.decode_dag_cbor(view[pos:], bytes, False)  # type: ignore[arg-type]  # any buffer
    except Exception as exc:  # cbrrr raises several types for malformed input
        raise FramingError("truncated_body", type(exc).__name__) from None
    return pos + n


def _seq_position(view: memoryview, count: int, pos: int) -> tuple[int, int]:
    """Walk top-level keys sorting before ``"seq"``: ``(entries passed, their end position)``.

    Raises ``seq_present`` if the map already has a ``seq`` key."""
    size = len(view)
    for index in range(count):
        kb = view[pos]
        if kb >> 5 != 3:
            raise FramingError("body_not_map", "non-text key")
        length = kb & 31
        if length > 3:  # longer keys sort after "seq" (and >= 24 means longer still)
            return index, pos
        key_end = pos + 1 + length
        if length == 3:
            key = view[pos:key_end].tobytes()
            if key == _SEQ_KEY:
                raise FramingError("seq_present")
            if key > _SEQ_KEY:
                return index, pos
        pos = _skip_value(view, key_end)
        if pos > size:
            raise FramingError("truncated_body")
    return count, pos


def seq_offset(body: bytes | memoryview) -> int:
    """Byte offset in ``body`` (a canonical DAG-CBOR map without ``seq``) where the ``seq``
    entry belongs (after the keys sorting before it)."""
    view = memoryview(body)
    try:
        count, start = _map_entries(view)
        return _seq_position(view, count, start)[1]
    except IndexError:
        raise FramingError("truncated_body") from None


def _sorts_before_seq(key: str) -> bool:
    """Canonical order compares UTF-8 bytes: length first, then bytewise."""
    raw = key.encode()
    return len(raw) < 3 or (len(raw) == 3 and raw < b"seq")


#: ``_sorts_before_seq`` of the keys the relay's outgoing bodies carry (the subscribeRepos lexicon's
#: fields), looked up instead of computed per key of every event.
_BEFORE_SEQ_KNOWN: dict[str, bool] = {
    k: _sorts_before_seq(k)
    for k in ("rebase", "tooBig", "repo", "commit", "rev", "since", "blocks", "ops", "blobs", "prevData",
              "time", "did", "handle", "active", "status", "name", "message")
}


def encode_unsequenced(body: dict[str, Any]) -> tuple[bytes, int]:
    """Encode ``body`` (without ``seq``) for ``PendingEvent.body_cbor``, with the offset of the
    ``seq`` entry (``PendingEvent.seq_offset``), for a producer that holds the dict anyway (a
    validation worker): two C-level encodes instead of a Python walk of the bytes."""
    if "seq" in body:
        raise FramingError("seq_present")
    encoded = cbrrr.encode_dag_cbor(body)
    known = _BEFORE_SEQ_KNOWN
    before = {k: v for k, v in body.items() if known.get(k) or (k not in known and _sorts_before_seq(k))}
    head = len(encode_head(5, len(body)))
    if not before:
        return encoded, head
    return encoded, head + len(cbrrr.encode_dag_cbor(before)) - len(encode_head(5, len(before)))


#: One-byte map heads ``a0``..``b7`` (0..23 entries), indexed by entry count.
_SMALL_MAP_HEADS = [bytes((0xA0 + n,)) for n in range(24)]


def splice_seq(body: bytes | memoryview, seq: int, prefix: bytes = b"", at: int | None = None) -> bytes:
    """``prefix`` + ``body`` (a canonical DAG-CBOR map without ``seq``) with ``"seq": seq``
    inserted at its canonical position — equal to ``prefix + encode({**decode(body), "seq": seq})``.

    ``at`` is the insertion offset when the producer already knows it (``encode_unsequenced``);
    otherwise the keys before it are walked (``seq_offset``). A wrong ``at`` gives a wrong frame:
    it must come from ``encode_unsequenced``/``seq_offset`` of these very bytes.
    """
    if type(seq) is not int or not 0 <= seq < _SEQ_LIMIT:
        raise FramingError("bad_seq", repr(seq))
    if not body:
        raise FramingError("truncated_body", "empty")
    first = body[0]
    if 0xA0 <= first < 0xB7:  # fast path: fewer than 23 entries, a one-byte head either way
        count, start, head = first - 0xA0, 1, _SMALL_MAP_HEADS[first - 0x9F]
    else:
        try:
            count, start = _map_entries(memoryview(body))
        except IndexError:
            raise FramingError("truncated_body") from None
        head = encode_head(5, count + 1)
    if at is None:
        try:
            at = _seq_position(memoryview(body), count, start)[1]
        except IndexError:
            raise FramingError("truncated_body") from None
    elif not start <= at <= len(body):
        raise FramingError("bad_offset", str(at))
    return b"".join((prefix, head, body[start:at], _SEQ_KEY, encode_head(0, seq), memoryview(body)[at:]))
