"""What a test writes to the test Redis database is removed after it.

The test database (``RELAY_TEST_REDIS_URL``) is shared by every test of a run and by the next runs:
a relay under test caches the identities it resolves there (``relay:identity:<did>``, an hour's
TTL) and keeps its event stream there, and a cached identity of a simulated host points at a port
that is dead once the test ends. ``keys_removed`` deletes every key created while it was open;
the ``redis_url`` fixture wraps each test that asks for Redis in it, and ``leftovers`` is the
session's final check (``tests/conftest.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis


def current_keys(url: str) -> set[bytes]:
    """Every key of ``url``'s database now (SCAN: never blocks the server)."""
    client = redis.Redis.from_url(url)
    try:
        return set(client.scan_iter(count=1000))
    finally:
        client.close()


@contextlib.contextmanager
def keys_removed(url: str) -> Iterator[None]:
    """Delete, on exit, every key of ``url``'s database that was not there on entry (keys that
    were there already are left alone, whoever wrote them)."""
    before = current_keys(url)
    try:
        yield
    finally:
        created = current_keys(url) - before
        if created:
            client = redis.Redis.from_url(url)
            try:
                client.delete(*created)
            finally:
                client.close()


def leftovers(url: str, before: set[bytes]) -> list[str]:
    """The keys of ``url``'s database that were not in ``before``, sorted, as text."""
    return sorted(k.decode(errors="replace") for k in current_keys(url) - before)
