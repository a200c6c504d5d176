"""Waiting on a condition in tests: poll it, fail loudly (naming what was awaited) after a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(predicate: Callable[[], bool], what: str = "the condition", timeout: float = 30.0,
                interval: float = 0.005) -> None:
    """Return as soon as ``predicate()`` holds; raise ``AssertionError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


async def until_async(check: Callable[[], Awaitable[bool]], what: str = "the condition", timeout: float = 30.0,
                      interval: float = 0.05) -> None:
    """``until`` for a condition that must be awaited (e.g. one that asks the relay to act)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)
