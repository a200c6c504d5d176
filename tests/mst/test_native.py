"""The compiled build of ``mst.node``/``mst.invert``/``mst.car`` (``mst.native``): it is what the
suite runs on, a stale or foreign build is never used, and the pure-Python sources pass the same
repository-core tests on their own."""

from __future__ import annotations

import importlib.machinery
import json
import os
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


def test_compiled_modules_are_the_ones_imported() -> None:
    modules = (mst.node, mst.invert, mst.car)
    if PURE:
        assert native.STATUS == "pure: RELAY_PURE_PYTHON is set"
        assert all(str(m.__file__).endswith(".py") for m in modules)
        return
    # `./run test` builds them (`relay native ensure --require`); a bare pytest needs `relay native build`
    assert native.active(), native.STATUS
    assert all(str(m.__file__).endswith(EXT) for m in modules), [m.__file__ for m in modules]
    assert native.check()[1] == "ok"


def test_a_build_is_used_only_for_its_own_sources_and_interpreter(tmp_path: Path) -> None:
    files = {name: f"{name.replace('.', '/')}{EXT}" for name in (*native.COMPILED_MODULES, "mst_native__mypyc")}
    for rel in files.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    digest = native.sources_digest()

    def manifest(**changes: object) -> None:
        m = {"interpreter": native._interpreter(), "sources": digest, "files": files, **changes}
        (tmp_path / "manifest.json").write_text(json.dumps(m))

    manifest()
    found, reason = native.check(tmp_path)
    assert reason == "ok" and found is not None and set(found) == set(files)
    manifest(sources="0" * 64)
    assert native.check(tmp_path) == (None, "stale: mst sources changed since the build")
    manifest(interpreter="Python 2.7")
    assert native.check(tmp_path) == (None, "built by another interpreter")
    manifest(files={k: v for k, v in files.items() if k != "mst.car"})
    assert native.check(tmp_path)[0] is None
    manifest()
    (tmp_path / files["mst.node"]).unlink()
    assert native.check(tmp_path) == (None, f"missing {files['mst.node']}")
    assert native.check(tmp_path / "nowhere")[1].startswith("no build in")


def test_sources_digest_covers_every_module_of_the_package(tmp_path: Path) -> None:
    pkg = tmp_path / "mst"
    pkg.mkdir()
    (pkg / "node.py").write_text("x = 1\n")
    (pkg / "cid.py").write_text("y = 2\n")
    before = native.sources_digest(pkg)
    (pkg / "cid.py").write_text("y = 3\n")  # not a compiled module, but the compiled ones import it
    assert native.sources_digest(pkg) != before


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
