"""Which store a URL opens: ``open_store`` picks the backend (PostgreSQL for ``postgresql://`` URLs,
else SQLite) and connects to it.

It lives apart from ``backfill.store`` (the ``Store`` contract both backends implement) so that the
contract imports neither backend: imports run backend → contract, never back.
"""

from __future__ import annotations

from backfill.postgres_store import PostgresStore
from backfill.sqlite_store import SqliteStore
from backfill.store import Store, is_postgres_url, split_schema, sqlite_path_from_url

__all__ = ["open_store"]


async def open_store(url: str | None = None, *, schema: str | None = None, pool_size: int = 4) -> Store:
    """Open (connect to) the store at ``url``; does not migrate (call ``migrate()``)."""
    if is_postgres_url(url):
        assert url is not None
        dsn, url_schema = split_schema(url)
        return await PostgresStore.connect(dsn, schema=schema or url_schema, pool_size=pool_size)
    return await SqliteStore.open(sqlite_path_from_url(url), readers=max(1, min(pool_size, 4)))
