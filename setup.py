"""The package build's one extra step: compile the verification hot path with mypyc.

Everything else (metadata, packages, package data) is in pyproject.toml. ``pip install .`` and
``pip install -e .`` run ``build_ext``, which here compiles copies of the Python sources
``mst/_node.py``, ``mst/_invert.py`` and ``mst/_car.py`` — unchanged except that they import each
other under the compiled names — into the extension modules ``mst._native_node``,
``mst._native_invert`` and ``mst._native_car`` (one mypyc group; its runtime library is
``mst._native__mypyc``). The compiled modules have their own names, so in an editable install they
sit beside the sources without shadowing them, and ``mst.native`` chooses between the two builds
with a plain import. Each copy records the SHA-256 of its source (``BUILT_FROM_SHA256``), so a
source edited after the build runs as Python until the next install.

Beside them it builds ``mst._accel`` from the C source ``mst/_accel.c`` (the native verification
path: CAR parsing with block hashing and MST operation inversion in one pass, linked with OpenSSL's
libcrypto for SHA-256; see ``mst.accel``). It records the SHA-256 of its source too, so an edited
source is not used until it is built again.

mypy (mypyc) and setuptools are build requirements only ([build-system] in pyproject.toml); the
installed relay does not need them. Without a C compiler the build warns and installs the
pure-Python package (``relay native status`` says so); ``RELAY_REQUIRE_COMPILED=1`` makes that an
error instead.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
#: the compiled modules, by their source's name in mst/ (``_node.py`` -> ``mst._native_node``)
COMPILED = ("node", "invert", "car")
GROUP = "mst._native"  # mypyc's shared runtime library: mst._native__mypyc
_IMPORT_RE = re.compile(r"\bmst\._(" + "|".join(COMPILED) + r")\b")


def native_source(name: str, text: str) -> str:
    """The module compiled as ``mst._native_<name>``: the source of ``mst/_<name>.py`` with its
    imports of the other compiled modules pointed at their compiled names (so the group calls
    itself natively), and the SHA-256 of the source it was made from."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return (_IMPORT_RE.sub(r"mst._native_\1", text)
            + f'\n\n#: SHA-256 of mst/_{name}.py, the source this module was compiled from\n'
            + f'BUILT_FROM_SHA256 = "{digest}"\n')


def _required() -> bool:
    return os.environ.get("RELAY_REQUIRE_COMPILED", "").lower() in ("1", "true", "yes")


class BuildCompiledMst(build_ext):
    """``build_ext`` whose extensions mypyc generates when it is set up for a build; not when
    setup.py is only asked for metadata (egg_info sets this command up too, to list sources)."""

    def finalize_options(self) -> None:
        dist = self.distribution
        if dist.ext_modules is PLACEHOLDERS and not set(dist.commands) <= METADATA_ONLY:
            try:
                dist.ext_modules = self._mypycify()
            except (Exception, SystemExit) as exc:  # no mypy, a type error (mypyc exits): Python still works
                if _required():
                    raise
                self.warn(f"compiled mst not built ({exc!r}); the pure-Python modules will be used")
                dist.ext_modules = [accel_extension()]
        super().finalize_options()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no C compiler: mst.native then falls back to Python
            if _required():
                raise
            self.warn(f"compiled mst: {ext.name} not built ({exc}); the pure-Python modules will be used")

    def _mypycify(self) -> list[Extension]:
        from mypyc.build import mypycify

        build_temp = self.build_temp or self.get_finalized_command("build").build_temp
        target = Path(build_temp).resolve() / "mypyc"
        work = Path(tempfile.mkdtemp(prefix="mst-mypyc-"))
        cwd = os.getcwd()
        try:
            (work / "mst").mkdir()
            for path in (ROOT / "mst").glob("*.py"):  # the package, for the types the copies import
                shutil.copy(path, work / "mst" / path.name)
            paths = []
            for name in COMPILED:
                text = (ROOT / "mst" / f"_{name}.py").read_text(encoding="utf-8")
                (work / "mst" / f"_native_{name}.py").write_text(native_source(name, text), encoding="utf-8")
                paths.append(f"mst/_native_{name}.py")
            os.chdir(work)  # mypyc names modules by their path, and reads no project configuration here
            extensions: list[Extension] = mypycify(paths, group_name=GROUP, opt_level="3", target_dir=str(target))
        finally:
            os.chdir(cwd)
            shutil.rmtree(work, ignore_errors=True)
        return [*extensions, accel_extension()]


def accel_extension() -> Extension:
    """``mst._accel`` from ``mst/_accel.c``, which records the SHA-256 of its source."""
    source = ROOT / "mst" / "_accel.c"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    return Extension(
        "mst._accel",
        sources=[str(source.relative_to(ROOT))],
        define_macros=[("ACCEL_SOURCE_SHA256", f'"{digest}"')],
        libraries=["crypto"],
        extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-deprecated-declarations"],
    )


# Placeholders naming the extension modules, so the wheel is built per platform and setuptools
# knows the outputs; BuildCompiledMst replaces them with mypyc's real ones.
PLACEHOLDERS = [Extension(f"mst._native_{name}", sources=[]) for name in COMPILED] + [
    Extension("mst._accel", sources=[])
]
#: commands that only describe the package: no compiling for them
METADATA_ONLY = {"egg_info", "dist_info", "sdist"}

setup(ext_modules=PLACEHOLDERS, cmdclass={"build_ext": BuildCompiledMst})
