"""Shared test configuration: locations of shared fixtures and the local services.

Tests use the real PostgreSQL and Redis on this machine. Override the addresses with
``RELAY_TEST_PG_DSN`` and ``RELAY_TEST_REDIS_URL``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("RELAY_SHARED_DIR", ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"
PG_DSN = os.environ.get("RELAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The shared public interop fixtures (``../shared/fixtures``)."""
    assert FIXTURES.is_dir(), f"shared fixtures not found at {FIXTURES}"
    return FIXTURES


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    return PG_DSN


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL
