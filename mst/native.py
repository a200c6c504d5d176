"""Optional compiled build of the verification hot path (``mst.node``, ``mst.invert``, ``mst.car``).

The Python sources stay the single source of truth. ``build()`` compiles exactly those modules,
unchanged, with mypyc (a C extension per module; measured on the 2-core box: full ``#commit``
verification +48 %, inversion +77 %, the repo producer +100 %) into ``.native/`` beside the
packages. ``activate()`` — run by ``mst/__init__`` before any submodule is imported — puts the
compiled modules on the import path only if they were built by this interpreter from exactly
the current ``mst/*.py`` sources; otherwise the pure-Python modules are used and ``STATUS``
says why. So an edited source is never shadowed by a stale build: it simply runs as Python
until the next ``build()`` (which ``./run`` does on every call when needed).

``RELAY_PURE_PYTHON=1`` forces the pure-Python modules (the test suite runs ``tests/mst`` that
way too); ``RELAY_NATIVE_DIR`` moves the build directory.

    relay native status | build | ensure [--require]
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

__all__ = ["COMPILED_MODULES", "STATUS", "activate", "active", "build", "check", "sources_digest"]

#: The modules compiled; everything else in ``mst`` always runs as Python.
COMPILED_MODULES = ("mst.node", "mst.invert", "mst.car")
_GROUP = "mst_native"  # name of mypyc's shared runtime library module: ``mst_native__mypyc``
_RUNTIME = f"{_GROUP}__mypyc"
_PACKAGE_DIR = Path(__file__).resolve().parent
_EXT = importlib.machinery.EXTENSION_SUFFIXES[0]

#: ``"compiled: …"`` when the compiled modules are in use, else ``"pure: <reason>"``.
STATUS = "pure: not activated"


def native_dir() -> Path:
    """Where builds live: ``$RELAY_NATIVE_DIR`` or ``.native/`` beside the ``mst`` package."""
    env = os.environ.get("RELAY_NATIVE_DIR")
    return Path(env) if env else _PACKAGE_DIR.parent / ".native"


def sources_digest(package_dir: Path = _PACKAGE_DIR) -> str:
    """SHA-256 over every ``mst/*.py`` (name and bytes, sorted): a build is valid only for these."""
    h = hashlib.sha256()
    for path in sorted(package_dir.glob("*.py")):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _interpreter() -> str:
    return f"{sys.version} {sys.base_prefix} {_EXT}"


def check(directory: Path | None = None, digest: str | None = None) -> tuple[dict[str, Path] | None, str]:
    """``(module name -> extension file, "ok")`` if ``directory`` holds a usable build, else
    ``(None, reason)``. Usable: same interpreter, same sources, every file present."""
    directory = directory or native_dir()
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except FileNotFoundError:
        return None, f"no build in {directory} (relay native build)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest in {directory}: {exc}"
    if manifest.get("interpreter") != _interpreter():
        return None, "built by another interpreter"
    if manifest.get("sources") != (digest or sources_digest()):
        return None, "stale: mst sources changed since the build"
    files: dict[str, Path] = {}
    for name, rel in manifest.get("files", {}).items():
        path = directory / rel
        if not path.is_file():
            return None, f"missing {rel}"
        files[name] = path
    if set(files) != {*COMPILED_MODULES, _RUNTIME}:
        return None, "build does not cover the compiled module set"
    return files, "ok"


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the compiled extension files for exactly the modules of one checked build."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def activate() -> str:
    """Use the compiled modules if a valid build exists (see module docstring); idempotent.
    Must run before ``mst.node``/``mst.invert``/``mst.car`` are first imported. Returns STATUS."""
    global STATUS
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return STATUS
    if os.environ.get("RELAY_PURE_PYTHON", "").lower() in ("1", "true", "yes"):
        STATUS = "pure: RELAY_PURE_PYTHON is set"
        return STATUS
    try:
        files, reason = check()
    except OSError as exc:  # unreadable sources (e.g. imported from a zip): just run as Python
        files, reason = None, f"cannot check sources: {exc}"
    if files is None:
        STATUS = f"pure: {reason}"
        return STATUS
    sys.meta_path.insert(0, _Finder(files))
    STATUS = "compiled: " + ", ".join(COMPILED_MODULES)
    return STATUS


def active() -> bool:
    """True if the compiled modules are the ones imported."""
    node = sys.modules.get("mst.node")
    return STATUS.startswith("compiled") and (node is None or str(node.__file__).endswith(_EXT))


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
setup(
    name="mst-native",
    ext_modules=mypycify(sys.argv[3:], group_name=sys.argv[2], opt_level="3"),
    script_args=["build_ext", "--build-lib", sys.argv[1], "--build-temp", "build-temp"],
)
"""


def build(directory: Path | None = None) -> Path:
    """Compile ``COMPILED_MODULES`` from the current sources into ``directory`` (replacing any
    earlier build there). Needs mypy (mypyc), setuptools and a C compiler with Python headers.
    Raises ``RuntimeError`` with the compiler's output on failure."""
    directory = directory or native_dir()
    digest = sources_digest()
    with tempfile.TemporaryDirectory(prefix="mst-native-") as tmp:
        work = Path(tmp)
        shutil.copytree(_PACKAGE_DIR, work / "mst", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        out = work / "out"
        sources = [f"{name.replace('.', '/')}.py" for name in COMPILED_MODULES]
        proc = subprocess.run(
            [sys.executable, "-c", _SETUP, str(out), _GROUP, *sources],
            cwd=work,
            capture_output=True,
            text=True,
            env={**os.environ, "RELAY_PURE_PYTHON": "1"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc build failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        files = {name: f"{name.replace('.', '/')}{_EXT}" for name in (*COMPILED_MODULES, _RUNTIME)}
        for rel in files.values():
            if not (out / rel).is_file():
                raise RuntimeError(f"mypyc build produced no {rel}")
        (out / "manifest.json").write_text(
            json.dumps({"interpreter": _interpreter(), "sources": digest, "files": files}, indent=1)
        )
        staging = directory.with_name(f"{directory.name}.new-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(out, staging)
        old = directory.with_name(f"{directory.name}.old-{os.getpid()}")
        if directory.exists():
            directory.rename(old)
        staging.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    return directory


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "status"
    require = "--require" in args
    if command == "status":
        files, reason = check()
        print(f"native build: {'ok' if files else reason}; this process: {STATUS}")
        return 0
    if command not in ("build", "ensure"):
        print("usage: relay native status | build | ensure [--require]", file=sys.stderr)
        return 2
    if command == "ensure" and check()[0] is not None:
        return 0
    print(f"mst.native: compiling {', '.join(COMPILED_MODULES)} with mypyc "
          "(once, and again whenever mst/ changes; ~30-60 s)...", file=sys.stderr)
    try:
        path = build()
    except Exception as exc:  # no compiler, no mypy, a type error: say so; Python still works
        print(f"mst.native: build failed; the pure-Python modules will be used.\n{exc}", file=sys.stderr)
        return 1 if require else 0
    print(f"mst.native: compiled {', '.join(COMPILED_MODULES)} into {path}", file=sys.stderr)
    return 0


