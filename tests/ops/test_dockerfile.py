"""The container image's Dockerfile: hadolint (with .hadolint.yaml) finds nothing, the build stage
copies every package the project installs, and the build is reproducible and cache-friendly —
the base image pinned by digest, every Python package at the version in constraints.txt (which
covers the whole runtime), dependencies installed before the sources are copied, a HEALTHCHECK,
no architecture-specific path."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.ops.constraints import build_requires, canonical, runtime_closure

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "Dockerfile").read_text()
#: the Dockerfile's instructions, continuation lines joined, comments dropped
INSTRUCTIONS = [line for line in re.sub(r"\\\n", " ", "\n".join(
    line for line in TEXT.splitlines() if not line.lstrip().startswith("#"))).splitlines() if line.strip()]


def stage(name: str) -> list[str]:
    """The instructions of one build stage."""
    starts = [i for i, line in enumerate(INSTRUCTIONS) if line.startswith("FROM ")]
    for n, i in enumerate(starts):
        if INSTRUCTIONS[i].endswith(f" AS {name}"):
            return INSTRUCTIONS[i:starts[n + 1] if n + 1 < len(starts) else len(INSTRUCTIONS)]
    raise AssertionError(f"no stage {name}")


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_has_the_stages_the_chart_names_and_copies_every_package() -> None:
    assert set(re.findall(r"^FROM \S+ AS (\w+)", TEXT, re.M)) == {"base", "build", "runtime", "spark"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools.packages.find]")[1].split("[")[0])
    copied = set(re.findall(r"^COPY (\w+) \./", TEXT, re.M))
    assert set(packages) <= copied, set(packages) - copied
    # the SQL migrations are package data of backfill, installed with it: nothing copies them by hand
    assert not [line for line in INSTRUCTIONS if "migrations" in line]
    assert "USER 10001:10001" in TEXT  # the chart's runAsUser


def test_base_image_is_pinned_by_digest() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", TEXT, re.M))
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], line.split()[1])
             for line in INSTRUCTIONS if line.startswith("FROM ")]
    stages = set(re.findall(r"^FROM \S+ AS (\w+)", TEXT, re.M))
    external = [b for b in bases if b not in stages]
    assert external and all(re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", b) for b in external), external


def test_dependencies_are_installed_before_the_sources_are_copied() -> None:
    build = stage("build")
    installs = [i for i, line in enumerate(build) if "pip install" in line and "-r requirements.txt" in line]
    first_source = min(i for i, line in enumerate(build) if re.match(r"COPY (mst|relay|firehose|backfill) ", line))
    assert installs and installs[0] < first_source
    # nothing but the dependency list and the pins is copied before that layer
    copied_before = [line for line in build[:installs[0]] if line.startswith("COPY ")]
    assert copied_before == ["COPY pyproject.toml constraints.txt ./"]
    # the project itself goes in afterwards without touching the dependencies
    assert any("pip install" in line and "--no-deps" in line for line in build[first_source:])


def test_every_pip_install_uses_the_constraints_and_they_pin_the_whole_runtime() -> None:
    installs = [line for line in INSTRUCTIONS if "pip install" in line]
    for line in installs:
        for command in re.split(r"&&", line):
            if "pip install" in command and "--no-deps" not in command:
                assert re.search(r"-c \S*constraints\.txt", command), command
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pins[canonical(name)] = version
    # every distribution the runtime (and the build's mst compiler, and the spark stage) needs
    assert set(pins) == set(runtime_closure()), set(pins) ^ set(runtime_closure())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["spark"] + build_requires()
    for raw in wanted:
        req = Requirement(raw)
        assert req.specifier.contains(pins[canonical(req.name)], prereleases=True), (raw, pins[canonical(req.name)])


def test_healthcheck_and_no_architecture_specific_paths() -> None:
    runtime = stage("runtime")
    [check] = [line for line in runtime if line.startswith("HEALTHCHECK ")]
    assert "http://127.0.0.1:2470/_health" in check
    assert 'EXPOSE 2470' in runtime and '"--bind", "0.0.0.0:2470"' in runtime[-1]
    assert "HEALTHCHECK NONE" in stage("spark")  # a batch job
    for line in INSTRUCTIONS:
        assert not re.search(r"amd64|x86_64|aarch64|arm64|i386", line), line
    assert "ENV JAVA_HOME=/usr/lib/jvm/default-java" in stage("spark")
