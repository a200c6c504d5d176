"""The fault suite's finalizer: whatever a test's own cleanup could not end (a timeout, an
interrupted event loop), every server process the harness started is killed after each test."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from tests.faults.harness import kill_leftovers


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    ended = kill_leftovers()
    if ended:
        warnings.warn(f"fault suite: {ended} server process(es) outlived their test and were killed", stacklevel=1)
