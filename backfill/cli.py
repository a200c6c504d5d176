"""``relay migrate``: apply the database migrations (the relay also applies them at start).

    relay migrate [--database-url URL] [--schema NAME]

URL defaults to ``$RELAY_DATABASE_URL``, else the embedded SQLite file ``./data/relay.sqlite``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from backfill.backends import open_store
from backfill.errors import BackfillError
from backfill.store import DEFAULT_SQLITE_PATH


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay migrate", description="Apply database migrations.")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("RELAY_DATABASE_URL") or DEFAULT_SQLITE_PATH,
        help="postgresql://… or a SQLite file path (default: $RELAY_DATABASE_URL or %(default)s)",
    )
    parser.add_argument("--schema", default=None, help="Postgres schema to migrate (default: search_path)")
    return parser


async def _migrate(url: str, schema: str | None) -> tuple[list[int], list[int]]:
    store = await open_store(url, schema=schema)
    try:
        applied = await store.migrate()
        return applied, await store.applied_migrations()
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        applied, all_versions = asyncio.run(_migrate(args.database_url, args.schema))
    except (BackfillError, OSError) as exc:
        print(f"relay migrate: {exc}", file=sys.stderr)
        return 1
    if applied:
        print(f"applied {len(applied)} migration(s): {', '.join(f'{v:04d}' for v in applied)}")
    else:
        print("database is up to date")
    print(f"schema version {max(all_versions) if all_versions else 0:04d} ({len(all_versions)} migration(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
