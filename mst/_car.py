"""CAR v1 read/write (https://ipld.io/specs/transport/car/carv1/), atproto flavour.

Reading verifies every block's sha-256 against its CID and enforces size limits; every failure
is a :class:`mst.errors.CARError` with a fixed ``reason``:

``car_truncated``, ``car_varint`` (malformed/non-minimal varint), ``car_header_invalid``,
``car_version``, ``car_no_roots``, ``car_cid_invalid`` (not a blessed CIDv1 sha-256 CID),
``car_hash_mismatch``, ``car_too_many_blocks``, ``car_block_too_large``, ``car_too_large``.

Duplicate blocks are tolerated (they are byte-identical once their hash is verified).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from mst import cbor
from mst.cid import CID, DAG_CBOR_PREFIX, RAW_PREFIX, SMALL_HASH_BYTES, sha256_small
from mst.errors import CARError, CBORError

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_BLOCK_BYTES",
    "DEFAULT_MAX_TOTAL_BYTES",
    "Car",
    "read_car",
    "write_car",
]

DEFAULT_MAX_BLOCKS = 10_000_000
DEFAULT_MAX_BLOCK_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 4 * 1024 * 1024 * 1024
_MAX_HEADER_BYTES = 64 * 1024
_sha256 = hashlib.sha256


@dataclass(slots=True)
class Car:
    """A parsed CAR: ``roots`` from the header, ``blocks`` keyed by (verified) CID."""

    roots: list[CID]
    blocks: dict[CID, bytes] = field(default_factory=dict)

    @property
    def root(self) -> CID:
        """The first root (for atproto CARs: the commit CID)."""
        return self.roots[0]


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """Unsigned LEB128 at ``pos``; returns (value, new_pos). Minimal encoding required."""
    if pos >= end:
        raise CARError("car_truncated", "varint past end of data")
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= end:
            raise CARError("car_truncated", "varint past end of data")
        if shift > 56:
            raise CARError("car_varint", "varint too long")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0:
                raise CARError("car_varint", "varint not minimally encoded")
            return value, pos
        shift += 7


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_car(
    data: bytes | bytearray | memoryview,
    *,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> Car:
    """Parse a CAR v1 file, verifying every block's hash; raises ``CARError``.

    Only blessed CIDs (CIDv1, dag-cbor or raw codec, sha-256/32) are accepted for blocks and
    roots. ``max_block_bytes`` bounds each block's data, ``max_total_bytes`` the whole input.
    """
    data = bytes(data)
    end = len(data)
    if end > max_total_bytes:
        raise CARError("car_too_large", f"{end} bytes > {max_total_bytes}")
    hlen, pos = _varint(data, 0, end)
    if hlen == 0 or hlen > _MAX_HEADER_BYTES:
        raise CARError("car_header_invalid", f"header length {hlen}")
    if pos + hlen > end:
        raise CARError("car_truncated", "header past end of data")
    try:
        header = cbor.decode(data[pos : pos + hlen])
    except CBORError as exc:
        raise CARError("car_header_invalid", exc.reason) from None
    if not isinstance(header, dict) or set(header) != {"roots", "version"}:
        raise CARError("car_header_invalid", "header must be {version, roots}")
    if header["version"] != 1 or type(header["version"]) is not int:
        raise CARError("car_version", f"unsupported CAR version {header['version']!r}")
    roots = header["roots"]
    if not isinstance(roots, list) or not all(isinstance(r, CID) for r in roots):
        raise CARError("car_header_invalid", "roots must be a list of CIDs")
    if not roots:
        raise CARError("car_no_roots", "CAR header has no roots")
    pos += hlen
    blocks: dict[CID, bytes] = {}
    # a block section takes at least 37 bytes (varint + CID): skip the per-block limit checks
    # when the input is too small to break them
    count_blocks = (end - pos) // 37 > max_blocks
    size_blocks = end - pos - 37 > max_block_bytes
    count = 0
    sha = _sha256
    small = sha256_small
    dag = DAG_CBOR_PREFIX
    raw = RAW_PREFIX
    while pos < end:
        b0 = data[pos]
        if b0 < 0x80:
            slen = b0
            pos += 1
        elif pos + 1 < end and 0 < data[pos + 1] < 0x80:  # two-byte varint (blocks < 16 KiB)
            slen = (b0 & 0x7F) | (data[pos + 1] << 7)
            pos += 2
        else:
            slen, pos = _varint(data, pos, end)
        sec_end = pos + slen
        if sec_end > end:
            raise CARError("car_truncated", "block section past end of data")
        cid_end = pos + 36
        cid_bytes = data[pos:cid_end]
        prefix = cid_bytes[:4]
        if slen < 36 or (prefix != dag and prefix != raw):
            raise CARError("car_cid_invalid", "block CID is not CIDv1 dag-cbor/raw sha-256")
        if size_blocks and slen - 36 > max_block_bytes:
            raise CARError("car_block_too_large", f"block of {slen - 36} bytes")
        if count_blocks:
            count += 1
            if count > max_blocks:
                raise CARError("car_too_many_blocks", f"more than {max_blocks} blocks")
        block = data[cid_end:sec_end]
        if prefix + (small(block) if slen < SMALL_HASH_BYTES else sha(block)).digest() != cid_bytes:
            raise CARError("car_hash_mismatch", "block does not hash to its CID")
        blocks[CID(cid_bytes)] = block
        pos = sec_end
    return Car(roots=roots, blocks=blocks)


def write_car(roots: list[CID], blocks: Iterable[tuple[CID, bytes]]) -> bytes:
    """Serialise a CAR v1 file with the given header roots and blocks (in the given order)."""
    header = cbor.encode({"version": 1, "roots": list(roots)})
    parts = [_encode_varint(len(header)), header]
    append = parts.append
    for cid, block in blocks:
        cb = cid.cid_bytes
        append(_encode_varint(len(cb) + len(block)))
        append(cb)
        append(block)
    return b"".join(parts)
