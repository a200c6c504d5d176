"""The pinned versions the container image installs (``constraints.txt``, used by the Dockerfile's
``pip install -c``): every distribution the runtime needs — the project's dependencies, its
build requirements ([build-system] requires: the mst build with mypyc) and the ``spark`` extra
(the Spark stage), with everything they require on Linux — at the version installed in this
environment.

Refresh after changing pyproject.toml or upgrading ``.venv``:

    .venv/bin/python -m tests.ops.constraints > constraints.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "atproto-relay"
EXTRAS = ("spark",)
#: installed into the image's venv by the Dockerfile itself (pip is upgraded first)
TOOLS = ("pip",)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(req: Requirement, extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))


def build_requires() -> list[str]:
    """[build-system] requires of pyproject.toml (the Dockerfile installs them for the build)."""
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"])


def runtime_closure() -> dict[str, str]:
    """``{canonical name: installed version}`` for the project's runtime requirements (with
    ``EXTRAS``) and everything they require, as installed here."""
    found: dict[str, str] = {}
    todo: list[tuple[str | None, tuple[str, ...]]] = [(PROJECT, EXTRAS), (None, ())]
    while todo:
        name, extras = todo.pop()
        # None stands for the project's build requirements (read from pyproject.toml)
        requires = metadata.distribution(name).requires if name else build_requires()
        for raw in requires or []:
            req = Requirement(raw)
            if not _applies(req, extras):
                continue
            key = canonical(req.name)
            if key in found:
                continue
            found[key] = metadata.version(req.name)
            todo.append((req.name, tuple(req.extras)))
    for tool in TOOLS:
        found[tool] = metadata.version(tool)
    found.pop(canonical(PROJECT), None)
    return found


def render() -> str:
    lines = [line.rstrip() for line in (__doc__ or "").strip().splitlines()]
    header = "\n".join(f"# {line}".rstrip() for line in lines)
    pins = "\n".join(f"{name}=={version}" for name, version in sorted(runtime_closure().items()))
    return f"{header}\n{pins}\n"


if __name__ == "__main__":
    sys.stdout.write(render())
