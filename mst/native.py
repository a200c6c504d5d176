"""Which build of the verification hot path (``mst.node``, ``mst.invert``, ``mst.car``) runs.

The Python sources ``mst/_node.py``, ``mst/_invert.py`` and ``mst/_car.py`` are the single source
of truth. The package build (``setup.py``, run by ``pip install .`` and ``pip install -e .``)
compiles copies of exactly those modules with mypyc into the extension modules
``mst._native_node``, ``mst._native_invert`` and ``mst._native_car`` (one group, runtime
``mst._native__mypyc``; measured on the 2-core box: full ``#commit`` verification about +50 %,
inversion +77 %, the repo producer +100 %). Nothing is compiled at run time.

The choice is a plain import, made once here: the compiled modules are used when all three
import and each was compiled from the current bytes of its source (``BUILT_FROM_SHA256``, so a
source edited after an editable install runs as Python until the next install instead of being
shadowed by a stale build); otherwise the pure-Python modules are used and :data:`STATUS` says
why. ``RELAY_PURE_PYTHON=1`` forces the pure-Python modules (the test suite runs ``tests/mst``
that way too). The public modules ``mst.node``, ``mst.invert`` and ``mst.car`` re-export the
chosen build, so every caller sees one set of classes.

In front of them, :mod:`mst.accel` puts the native verification path, the C extension
``mst._accel`` (``mst/_accel.c``, also built by ``setup.py``): ``mst.car.read_car`` and
``mst.invert.invert_ops`` try it first and fall back to the modules above for anything it does
not accept. It is used (:data:`ACCEL`) when it imports and was built from the current bytes of its
source; ``RELAY_PURE_PYTHON=1`` turns it off too.

    relay native status
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from pathlib import Path

__all__ = ["ACCEL", "ACCEL_STATUS", "COMPILED", "COMPILED_MODULES", "STATUS", "active", "source_digest"]

#: The public modules whose implementation is chosen here; everything else in ``mst`` is Python.
COMPILED_MODULES = ("mst.node", "mst.invert", "mst.car")
_PACKAGE_DIR = Path(__file__).resolve().parent


def source_digest(name: str, package_dir: Path = _PACKAGE_DIR, suffix: str = ".py") -> str:
    """SHA-256 of the source of ``mst.<name>`` (``mst/_<name>.py``, or ``.c`` for the native
    path): a compiled module is used only if it was built from these bytes."""
    return hashlib.sha256((package_dir / f"_{name}{suffix}").read_bytes()).hexdigest()


def _choose() -> tuple[bool, str]:
    if os.environ.get("RELAY_PURE_PYTHON", "").lower() in ("1", "true", "yes"):
        return False, "pure: RELAY_PURE_PYTHON is set"
    for public in COMPILED_MODULES:
        name = public.removeprefix("mst.")
        try:
            module = importlib.import_module(f"mst._native_{name}")
        except ImportError as exc:
            return False, f"pure: no compiled build ({exc}); reinstall with a C compiler (pip install .)"
        built_from = getattr(module, "BUILT_FROM_SHA256", None)
        try:
            current = source_digest(name)
        except OSError as exc:  # sources not readable as files (e.g. imported from a zip)
            return False, f"pure: cannot check the sources ({exc})"
        if built_from != current:
            return False, f"pure: stale build (mst/_{name}.py changed since it was compiled; pip install again)"
    return True, "compiled: " + ", ".join(COMPILED_MODULES)




def _choose_accel() -> tuple[bool, str]:
    if os.environ.get("RELAY_PURE_PYTHON", "").lower() in ("1", "true", "yes"):
        return False, "off: RELAY_PURE_PYTHON is set"
    try:
        module = importlib.import_module("mst._accel")
    except ImportError as exc:
        return False, f"off: not built ({exc}); reinstall with a C compiler and libssl-dev (pip install .)"
    try:
        current = source_digest("accel", suffix=".c")
    except OSError as exc:
        return False, f"off: cannot check the source ({exc})"
    if getattr(module, "BUILT_FROM_SHA256", None) != current:
        return False, "off: stale build (mst/_accel.c changed since it was compiled; pip install again)"
    return True, "on: mst._accel (CAR parsing and inversion)"


#: True when ``mst.car.read_car`` and ``mst.invert.invert_ops`` try ``mst._accel`` first.
ACCEL, ACCEL_STATUS = _choose_accel()

#: True when the compiled modules are the ones ``mst.node``/``mst.invert``/``mst.car`` export.
#: (Decided after ``ACCEL``: importing them imports ``mst.cbor``, which reads ``ACCEL``.)
COMPILED, STATUS = _choose()


def active() -> bool:
    """True if the compiled modules are in use (``STATUS`` starts with ``"compiled"``)."""
    return COMPILED


def main(argv: list[str] | None = None) -> int:
    """``relay native status``: print which build this interpreter uses."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["status"]):
        print("usage: relay native status", file=sys.stderr)
        return 2
    print(f"mst: {STATUS}")
    print(f"native verification path: {ACCEL_STATUS}")
    return 0
