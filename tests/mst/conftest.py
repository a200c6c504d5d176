"""Fixtures for the repository-core tests: paths to the shared interop vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def interop_dir(fixtures_dir: Path) -> Path:
    return fixtures_dir / "interop"


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
