"""The pinned versions the container image installs (``constraints.txt``, used by the Dockerfile's
``pip install -c``): every distribution the runtime needs — the project's dependencies, the
``native`` extra (the mst build) and the ``spark`` extra (the Spark stage), with everything they
require on Linux — at the version installed in this environment.

Refresh after changing pyproject.toml or upgrading ``.venv``:

    .venv/bin/python -m tests.ops.constraints > constraints.txt
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement

PROJECT = "atproto-relay"
EXTRAS = ("native", "spark")
#: installed into the image's venv by the Dockerfile itself (pip is upgraded first)
TOOLS = ("pip",)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(req: Requirement, extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))


def runtime_closure() -> dict[str, str]:
    """``{canonical name: installed version}`` for the project's runtime requirements (with
    ``EXTRAS``) and everything they require, as installed here."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(PROJECT, EXTRAS)]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        for raw in dist.requires or []:
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
