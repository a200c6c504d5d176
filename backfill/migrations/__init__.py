"""Discovery of ordered SQL migrations (``<dialect>/NNNN_name.sql`` in this package).

The SQL files ship inside the installed package (package data of ``backfill.migrations``) and are
found through :mod:`importlib.resources`, so an installed relay needs nothing copied beside it.
Pure file handling; the stores apply them. Every file is applied once, in numeric order, and
recorded in ``schema_migrations``. Number ranges belong to packages (see ARCHITECTURE.md), so
the runner simply takes every file it finds.
"""

from __future__ import annotations

import os
import re
import sqlite3
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from backfill.errors import MigrationError

_FILE_RE = re.compile(r"^(\d{4})_([A-Za-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file: ``version`` is its 4-digit number."""

    version: int
    name: str
    sql: str


def migrations_root() -> Traversable:
    """Where the ``<dialect>/`` folders are: ``$RELAY_MIGRATIONS_DIR`` if set, else this package's
    own resources (the files installed with it)."""
    env = os.environ.get("RELAY_MIGRATIONS_DIR")
    if env:
        return Path(env)
    return files(__name__)


def discover(dialect: str, root: Traversable | None = None) -> list[Migration]:
    """All migrations for ``dialect`` ("postgres" or "sqlite"), sorted by version.

    Raises ``MigrationError`` for a file that looks like a migration but is misnamed, or for two
    files with the same number.
    """
    folder = (root or migrations_root()) / dialect
    if not folder.is_dir():
        raise MigrationError(f"migrations folder not found: {folder}", reason="migrations_missing")
    found: dict[int, Migration] = {}
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".sql"):
            continue
        match = _FILE_RE.match(path.name)
        if not match:
            raise MigrationError(f"bad migration file name: {path.name}", reason="migration_bad_name")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(
                f"two migrations numbered {version:04d}: {found[version].name} and {match.group(2)}",
                reason="migration_duplicate",
            )
        found[version] = Migration(version, match.group(2), path.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


def split_sqlite_statements(sql: str) -> list[str]:
    """Split a script into complete statements (trigger bodies stay whole).

    Needed because ``sqlite3.executescript`` commits first, which would break the one
    transaction per migration file.
    """
    statements: list[str] = []
    buf = ""
    for line in sql.splitlines(keepends=True):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("--")):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            statements.append(buf.strip())
            buf = ""
    if buf.strip():
        raise MigrationError("incomplete statement at end of migration", reason="migration_bad_sql")
    return statements
