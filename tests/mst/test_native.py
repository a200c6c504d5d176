"""The compiled build of ``mst.node``/``mst.invert``/``mst.car`` (made by the package build,
chosen in ``mst.native`` by a plain import): it is what the suite runs on, it is one consistent
group (the pure modules are not loaded beside it), a stale or missing build is never used, and
the pure-Python sources pass the same repository-core tests on their own."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mst.car
import mst.invert
import mst.node
from mst import native

ROOT = Path(__file__).resolve().parents[2]
PURE = os.environ.get("RELAY_PURE_PYTHON", "").lower() in ("1", "true", "yes")
EXT = importlib.machinery.EXTENSION_SUFFIXES[0]
NAMES = ("node", "invert", "car")


def test_compiled_modules_are_the_ones_imported() -> None:
    if PURE:
        assert native.STATUS == "pure: RELAY_PURE_PYTHON is set" and not native.active()
        assert mst.node.load_node is sys.modules["mst._node"].load_node
        assert not [m for m in sys.modules if m.startswith("mst._native")]
        assert not native.ACCEL and mst.invert.invert_ops is sys.modules["mst._invert"].invert_ops
        return
    # `./run test` builds them (pip install -e . runs setup.py's mypyc step)
    assert native.active(), native.STATUS
    for name in NAMES:
        compiled = sys.modules[f"mst._native_{name}"]
        assert str(compiled.__file__).endswith(EXT), compiled.__file__
        assert compiled.BUILT_FROM_SHA256 == native.source_digest(name)
    assert mst.node.load_node is sys.modules["mst._native_node"].load_node
    # the native path (mst._accel, also built by setup.py) in front of the compiled reference
    assert native.ACCEL, native.ACCEL_STATUS
    accel = sys.modules["mst._accel"]
    assert str(accel.__file__).endswith(EXT) and accel.BUILT_FROM_SHA256 == native.source_digest("accel", suffix=".c")
    assert mst.invert.invert_ops.__qualname__ == "accelerated_invert_ops.<locals>.invert_ops"
    assert mst.car.read_car.__qualname__ == "accelerated_read_car.<locals>.read_car"
    # one group: the compiled invert calls the compiled node (not the Python source)
    assert sys.modules["mst._native_invert"].load_node is mst.node.load_node
    assert type(mst.node.empty_node()) is mst.node.Node


def _status_of(package_root: Path, status: str = "STATUS", module: str = "mst.node") -> str:
    """``mst.native.<status>`` in a fresh interpreter that imports ``mst`` from ``package_root``
    only (checked on ``module``; an editable install's finder, which would serve the checkout's
    modules, is dropped)."""
    env = {k: v for k, v in os.environ.items() if k != "RELAY_PURE_PYTHON"}
    env["PYTHONPATH"] = str(package_root)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]\n"
            f"import mst.native, {module}; assert {module}.__file__.startswith(sys.argv[1]); "
            f"print(mst.native.{status})")
    done = subprocess.run([sys.executable, "-c", code, str(package_root)],
                          cwd=package_root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _accel_status_of(package_root: Path) -> str:
    return _status_of(package_root, "ACCEL_STATUS", "mst.native")


def test_a_stale_or_missing_build_is_not_used(tmp_path: Path) -> None:
    if PURE:
        return
    copy = tmp_path / "mst"
    shutil.copytree(ROOT / "mst", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _status_of(tmp_path).startswith("compiled: ")  # the copy itself is used (not the checkout)
    source = copy / "_invert.py"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    assert _status_of(tmp_path) == "pure: stale build (mst/_invert.py changed since it was compiled; pip install again)"
    shutil.copy(ROOT / "mst" / "_invert.py", source)
    for so in copy.glob(f"_native_car{EXT}"):
        so.unlink()
    assert _status_of(tmp_path).startswith("pure: no compiled build")
    source = copy / "_accel.c"
    source.write_text(source.read_text() + "\n/* edited after the build */\n")
    assert _accel_status_of(tmp_path) == "off: stale build (mst/_accel.c changed since it was compiled; pip install again)"
    for so in copy.glob(f"_accel{EXT}"):
        so.unlink()
    assert _accel_status_of(tmp_path).startswith("off: not built")


def test_pure_python_sources_pass_the_repository_core_suite() -> None:
    if PURE:  # this is that run
        return
    env = {**os.environ, "RELAY_PURE_PYTHON": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mst",
         "--deselect", "tests/mst/test_native.py::test_pure_python_sources_pass_the_repository_core_suite"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
