"""The container image's Dockerfile: hadolint (with .hadolint.yaml) finds nothing, and the build
stage copies every package the project installs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_has_the_stages_the_chart_names_and_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert set(re.findall(r"^FROM \S+ AS (\w+)", text, re.M)) == {"base", "build", "runtime", "spark"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools.packages.find]")[1].split("[")[0])
    copied = set(re.findall(r"^COPY (\w+) \./", text, re.M))
    assert set(packages) | {"migrations"} <= copied, set(packages) - copied
    assert "USER 10001:10001" in text  # the chart's runAsUser
