"""``relay inspect``: look inside a repository CAR file or a raw firehose frame.

    relay inspect car FILE [--did-key did:key:z…] [--json]
    relay inspect frame FILE [--json]

``car`` prints the commit (DID, rev, data root, commit CID), the number of blocks and records
(walking the whole tree; a partial CAR such as a #commit slice reports which block is missing)
and, with ``--did-key``, whether the commit signature verifies. ``frame`` decodes a raw
``subscribeRepos`` frame (header + body) and summarises the body, including the ops and the
embedded CAR of ``#commit``/``#sync`` events.

This is the only module of ``mst`` that does I/O (reading FILE, printing). Exit status: 0 on
success, 1 if the input is invalid or the signature does not verify, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mst import cbor
from mst.car import Car, read_car
from mst.cid import CID
from mst.commit import decode_commit, verify_commit_sig
from mst.crypto import parse_did_key
from mst.datamodel import data_to_json
from mst.errors import RepoError
from mst.node import iter_items, load_node

__all__ = ["main", "summarize_car", "summarize_frame"]


def _cid(v: object) -> str | None:
    return v.encode() if isinstance(v, CID) else None


def summarize_car(data: bytes, did_key: str | None = None) -> dict[str, Any]:
    """A JSON-able summary of a CAR (see module doc). Raises ``RepoError`` if unreadable."""
    car = read_car(data)
    out: dict[str, Any] = {
        "roots": [r.encode() for r in car.roots],
        "blocks": len(car.blocks),
        "bytes": len(data),
    }
    block = car.blocks.get(car.roots[0])
    if block is None:
        out["commit"] = None
        out["error"] = "commit_missing"
        return out
    commit = decode_commit(block)
    out["commit"] = {
        "cid": car.roots[0].encode(),
        "did": commit.did,
        "version": commit.version,
        "rev": commit.rev,
        "data": commit.data.encode(),
        "prev": _cid(commit.prev),
    }
    out.update(_walk(car, commit.data))
    if did_key is not None:
        out["signature_valid"] = verify_commit_sig(commit, parse_did_key(did_key))
    return out


def _walk(car: Car, root: CID) -> dict[str, Any]:
    count = 0
    missing_records = 0
    try:
        node = load_node(car.blocks, root, None)
        for _, cid in iter_items(car.blocks, None if node.is_empty else node):
            count += 1
            if cid not in car.blocks:
                missing_records += 1
    except RepoError as exc:
        return {"tree": "partial", "tree_error": exc.reason, "records_seen": count}
    return {"tree": "complete", "records": count, "record_blocks_missing": missing_records}


def summarize_frame(data: bytes) -> dict[str, Any]:
    """A JSON-able summary of a raw event-stream frame. Raises ``RepoError`` if undecodable."""
    header, n = cbor.decode_prefix(data)
    body = cbor.decode(data[n:])
    out: dict[str, Any] = {"bytes": len(data), "header": data_to_json(header)}
    if not isinstance(body, dict):
        out["body"] = data_to_json(body)
        return out
    summary: dict[str, Any] = {}
    for key, value in body.items():
        if key == "blocks" and isinstance(value, bytes):
            try:
                car = read_car(value)
                summary["blocks"] = {
                    "bytes": len(value),
                    "blocks": len(car.blocks),
                    "roots": [r.encode() for r in car.roots],
                }
            except RepoError as exc:
                summary["blocks"] = {"bytes": len(value), "error": exc.reason}
        elif isinstance(value, bytes):
            summary[key] = {"bytes": len(value)}
        else:
            summary[key] = data_to_json(value)
    out["body"] = summary
    return out


def _print(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return

    def emit(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value and not set(value) <= {"$link", "$bytes"}:
            for k, v in value.items():
                emit(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, dict) and "$link" in value:
            print(f"{prefix}: {value['$link']}")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, v in enumerate(value):
                emit(f"{prefix}[{i}]", v)
        else:
            print(f"{prefix}: {value}")

    emit("", summary)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relay inspect", description="Inspect a repo CAR or a firehose frame.")
    sub = ap.add_subparsers(dest="what", required=True)
    car_p = sub.add_parser("car", help="a repository CAR file (full export or #commit slice)")
    car_p.add_argument("file", type=Path)
    car_p.add_argument("--did-key", help="check the commit signature against this did:key")
    car_p.add_argument("--json", action="store_true", help="print JSON")
    frame_p = sub.add_parser("frame", help="a raw subscribeRepos frame (header + body)")
    frame_p.add_argument("file", type=Path)
    frame_p.add_argument("--json", action="store_true", help="print JSON")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        print(f"relay inspect: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        if args.what == "car":
            summary = summarize_car(data, args.did_key)
        else:
            summary = summarize_frame(data)
    except RepoError as exc:
        print(f"relay inspect: invalid input: {exc.reason}: {exc.message}", file=sys.stderr)
        return 1
    _print(summary, args.json)
    if summary.get("signature_valid") is False or summary.get("error"):
        return 1
    return 0
