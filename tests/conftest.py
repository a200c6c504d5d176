"""Shared test configuration: locations of shared fixtures and the local services.

Tests use the real PostgreSQL and Redis on this machine. Override the addresses with
``RELAY_TEST_PG_DSN`` and ``RELAY_TEST_REDIS_URL``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests import hypothesis_budget
from tests.redis_keys import current_keys, keys_removed, leftovers

hypothesis_budget.load()  # RELAY_HYPOTHESIS_PROFILE (``mutation`` under ./run mutate)

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


@pytest.fixture
def redis_url() -> Iterator[str]:
    """The test Redis database; every key the test creates there is deleted after it."""
    with keys_removed(REDIS_URL):
        yield REDIS_URL


@pytest.fixture(scope="session", autouse=True)
def redis_left_as_found() -> Iterator[None]:
    """After the whole run, the test Redis database holds no key it did not hold before."""
    try:
        before = current_keys(REDIS_URL)
    except redis.ConnectionError:  # no Redis here: the tests that need it fail on their own
        yield
        return
    yield
    left = leftovers(REDIS_URL, before)
    assert not left, f"tests left {len(left)} keys in {REDIS_URL}: {left[:10]}"
