"""The native verification path: ``mst._accel`` (C, ``mst/_accel.c``) in front of the reference.

``mst._accel`` parses a CAR with every block hash checked, and inverts a commit's operations on
its partial tree (node decoding, the persistent tree updates, re-encoding and hashing) in one
compiled pass. It only ever *accepts*: for input that is canonical and well formed it returns
exactly what the reference implementation returns (``mst/_car.py``'s ``read_car``,
``mst/_invert.py``'s ``invert_ops``); for anything else (malformed, non-canonical, over a limit,
an error of any kind, or merely unusual) it returns ``None`` and the wrappers here run the
reference, which gives the result or raises the typed error with its reason. Verdicts and
reasons are therefore those of the reference by construction (tests/mst/test_accel.py checks it
differentially on the interop vectors and on randomized repositories).

:mod:`mst.native` decides whether it is used (``ACCEL``; off with ``RELAY_PURE_PYTHON=1``, or
when the extension is missing or was built from another version of ``mst/_accel.c``); the public
``mst.car.read_car`` and ``mst.invert.invert_ops`` are these wrappers when it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from mst.cid import CID
from mst.ops import RepoOp

__all__ = ["accelerated_invert_ops", "accelerated_read_car", "module"]

BlockMap = Mapping[CID, bytes]


def module() -> ModuleType:
    """The extension module ``mst._accel``, initialised (raises ``ImportError`` if not built)."""
    accel = importlib.import_module("mst._accel")
    accel.init(CID)
    return accel


def accelerated_read_car(build: ModuleType, accel: ModuleType) -> Callable[..., Any]:
    """``read_car`` (same signature and contract as ``build.read_car``, the reference of the
    build in use) trying ``accel`` first; results are ``build.Car``."""
    native = accel.read_car
    reference = build.read_car
    car_class = build.Car

    def read_car(
        data: bytes | bytearray | memoryview,
        *,
        max_blocks: int = build.DEFAULT_MAX_BLOCKS,
        max_block_bytes: int = build.DEFAULT_MAX_BLOCK_BYTES,
        max_total_bytes: int = build.DEFAULT_MAX_TOTAL_BYTES,
    ) -> Any:
        got = native(data, max_blocks, max_block_bytes, max_total_bytes)
        if got is None:
            return reference(data, max_blocks=max_blocks, max_block_bytes=max_block_bytes,
                             max_total_bytes=max_total_bytes)
        return car_class(got[0], got[1])

    read_car.__doc__ = reference.__doc__
    return read_car


def accelerated_invert_ops(reference: Callable[[BlockMap, CID, Sequence[RepoOp]], CID],
                           accel: ModuleType) -> Callable[[BlockMap, CID, Sequence[RepoOp]], CID]:
    """``invert_ops`` (same signature and contract as ``reference``) trying ``accel`` first."""
    native = accel.invert

    def invert_ops(blocks: BlockMap, root: CID, ops: Sequence[RepoOp]) -> CID:
        got = native(blocks, root, ops)
        if got is None:
            return reference(blocks, root, ops)
        return got  # type: ignore[no-any-return]

    invert_ops.__doc__ = reference.__doc__
    return invert_ops
