"""An independent Jetstream decoder and expectation builder, written from the public Jetstream
documentation (README "Consuming Jetstream": message kinds, fields, filters, zstd compression)
and the atproto event-stream and data-model specs — none of the relay's own code is used: frames
and records are decoded with the ``dag-cbor``/``multiformats`` packages, CAR files by hand.

``expected(frames)`` turns the relay's ``subscribeRepos`` frames into the Jetstream messages the
documentation says they become (without ``time_us``, which only the relay knows), each tagged
with the event's ``seq`` under ``"_seq"``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

import dag_cbor
import zstandard
from multiformats import CID


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def car_blocks(car: bytes) -> dict[str, bytes]:
    """CAR v1: varint-prefixed header, then varint-prefixed (CID bytes + block) sections."""
    size, pos = _varint(car, 0)
    pos += size
    out: dict[str, bytes] = {}
    while pos < len(car):
        size, pos = _varint(car, pos)
        section = car[pos:pos + size]
        pos += size
        # CIDv1: version, codec, multihash (code, length, digest)
        _, p = _varint(section, 0)
        _, p = _varint(section, p)
        _, p = _varint(section, p)
        length, p = _varint(section, p)
        cid = CID.decode(section[:p + length])
        out[str(cid.encode("base32"))] = section[p + length:]
    return out


def to_json(value: Any) -> Any:
    """The atproto JSON data model: links as ``{"$link"}``, bytes as ``{"$bytes"}`` (base64, no padding)."""
    if isinstance(value, CID):
        return {"$link": str(value.encode("base32"))}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode().rstrip("=")}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def decode_frame(frame: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    header, body = dag_cbor.decode(frame, allow_concat=True), None
    size = len(dag_cbor.encode(header))
    body = dag_cbor.decode(frame[size:])
    assert isinstance(header, dict) and isinstance(body, dict)
    return header, body


def expected(frames: Iterable[bytes]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for frame in frames:
        header, body = decode_frame(frame)
        t = header.get("t")
        seq = body.get("seq")
        if t == "#commit":
            blocks = car_blocks(body["blocks"])
            for op in body["ops"]:
                collection, rkey = op["path"].split("/", 1)
                commit: dict[str, Any] = {"rev": body["rev"], "operation": op["action"],
                                          "collection": collection, "rkey": rkey}
                if op["action"] != "delete":
                    cid = str(op["cid"].encode("base32"))
                    commit["record"] = to_json(dag_cbor.decode(blocks[cid]))
                    commit["cid"] = cid
                out.append({"did": body["repo"], "kind": "commit", "commit": commit, "_seq": seq})
        elif t in ("#identity", "#account"):
            kind = t[1:]
            inner = to_json(body)
            if kind == "identity" and not isinstance(inner.get("handle"), str):
                # Jetstream clients require a string handle; the atproto handle spec names one
                # that is absent or does not verify "handle.invalid"
                inner["handle"] = "handle.invalid"
            out.append({"did": body["did"], "kind": kind, kind: inner, "_seq": seq})
    return out


def wanted(msg: dict[str, Any], collections: list[str] = (), dids: list[str] = ()) -> bool:  # type: ignore[assignment]
    """The documented filters: identity and account messages pass every collection filter;
    ``prefix.*`` matches whole NSID segments."""
    if dids and msg["did"] not in dids:
        return False
    if msg["kind"] != "commit" or not collections:
        return True
    c = msg["commit"]["collection"]
    return any(c == w or (w.endswith(".*") and c.startswith(w[:-1])) for w in collections)


def strip(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k not in ("time_us", "_seq")}


def decompress(data: bytes, dictionary: bytes) -> dict[str, Any]:
    """A compressed message is one zstd frame made with the served dictionary."""
    d = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary))
    parsed: dict[str, Any] = json.loads(d.decompress(data))
    return parsed
