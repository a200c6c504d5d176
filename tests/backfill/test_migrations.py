"""The migration runner: every file in numeric order, recorded once, idempotent, safe from two
runners at once (tasks and processes), on both backends."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

from backfill import cli
from backfill.errors import MigrationError
from backfill.migrations import discover, migrations_root, split_sqlite_statements
from tests.backfill.conftest import StoreTarget

REPO = Path(__file__).resolve().parents[2]

EXTRA = {
    "postgres": {
        # Written out of order on purpose; 0070 depends on 0050, which depends on 0001.
        "0070_spark_results.sql": "ALTER TABLE crawl_requests ADD COLUMN job text;",
        "0050_relay_crawl.sql": "CREATE TABLE crawl_requests (hostname text REFERENCES hosts (hostname));",
    },
    "sqlite": {
        "0070_spark_results.sql": "ALTER TABLE crawl_requests ADD COLUMN job TEXT;",
        "0050_relay_crawl.sql": (
            "CREATE TABLE crawl_requests (hostname TEXT REFERENCES hosts (hostname));\n"
            "CREATE TRIGGER crawl_lower AFTER INSERT ON crawl_requests BEGIN\n"
            "  UPDATE crawl_requests SET hostname = lower(new.hostname) WHERE rowid = new.rowid;\n"
            "END;\n"
        ),
    },
}


def copy_migrations(tmp_path: Path) -> Path:
    """A migrations folder holding only this package's own files (0001-0049)."""
    root = tmp_path / "migrations"
    for dialect in ("postgres", "sqlite"):
        (root / dialect).mkdir(parents=True)
        for path in (migrations_root() / dialect).iterdir():
            if re.fullmatch(r"00[0-4]\d_\w+\.sql", path.name):
                (root / dialect / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return root


def own_versions() -> list[int]:
    return [m.version for m in discover("sqlite") if m.version < 50]


async def test_migrate_is_idempotent(target: StoreTarget) -> None:
    store = await target.open()
    try:
        expected = [m.version for m in discover(target.backend)]
        assert await store.migrate() == expected
        assert await store.migrate() == []
        assert await store.applied_migrations() == expected
        assert await store.latest_seq() == 0  # the metadata row exists exactly once
    finally:
        await store.close()


async def test_migrate_concurrently_from_two_stores(target: StoreTarget) -> None:
    a, b = await target.open(), await target.open()
    try:
        ra, rb = await asyncio.gather(a.migrate(), b.migrate())
        expected = [m.version for m in discover(target.backend)]
        assert sorted(ra + rb) == expected  # each file applied by exactly one runner
        assert await a.applied_migrations() == expected
    finally:
        await a.close()
        await b.close()


async def test_migrate_from_two_processes(target: StoreTarget) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "backfill.cli",
            "--database-url",
            target.full_url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 60)
    assert [p.returncode for p in procs] == [0, 0], outputs
    texts = [out.decode() for out, _ in outputs]
    assert sum(t.startswith("applied ") for t in texts) == 1
    assert sum("database is up to date" in t for t in texts) == 1
    store = await target.open()
    try:
        assert await store.applied_migrations() == [m.version for m in discover(target.backend)]
        assert await store.latest_seq() == 0
    finally:
        await store.close()


async def test_runner_takes_every_owners_files_in_numeric_order(
    target: StoreTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_migrations(tmp_path)
    for name, sql in EXTRA[target.backend].items():
        (root / target.backend / name).write_text(sql)
    monkeypatch.setenv("RELAY_MIGRATIONS_DIR", str(root))
    store = await target.open()
    try:
        assert await store.migrate() == [*own_versions(), 50, 70]
        (root / target.backend / "0071_later.sql").write_text("CREATE TABLE later_table (x integer);")
        assert await store.migrate() == [71]
        assert await store.applied_migrations() == [*own_versions(), 50, 70, 71]
    finally:
        await store.close()


async def test_failed_migration_is_not_recorded(
    target: StoreTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_migrations(tmp_path)
    (root / target.backend / "0060_broken.sql").write_text(
        "CREATE TABLE half_done (x integer);\nTHIS IS NOT SQL;\n"
    )
    monkeypatch.setenv("RELAY_MIGRATIONS_DIR", str(root))
    store = await target.open()
    try:
        with pytest.raises(MigrationError) as info:
            await store.migrate()
        assert info.value.reason == "migration_failed" and "0060_broken" in str(info.value)
        assert await store.applied_migrations() == own_versions()
        # The failed file left nothing behind: fixing it lets it apply cleanly.
        (root / target.backend / "0060_broken.sql").write_text("CREATE TABLE half_done (x integer);")
        assert await store.migrate() == [60]
    finally:
        await store.close()


def test_bad_and_duplicate_file_names(tmp_path: Path) -> None:
    folder = tmp_path / "postgres"
    folder.mkdir()
    (folder / "0001_a.sql").write_text("SELECT 1;")
    (folder / "README.txt").write_text("not a migration")
    assert [m.version for m in discover("postgres", tmp_path)] == [1]
    (folder / "1_b.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError) as info:
        discover("postgres", tmp_path)
    assert info.value.reason == "migration_bad_name"
    (folder / "1_b.sql").unlink()
    (folder / "0001_c.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError) as info:
        discover("postgres", tmp_path)
    assert info.value.reason == "migration_duplicate"
    with pytest.raises(MigrationError) as info:
        discover("sqlite", tmp_path)
    assert info.value.reason == "migrations_missing"


def test_split_sqlite_statements_keeps_triggers_whole() -> None:
    statements = split_sqlite_statements(EXTRA["sqlite"]["0050_relay_crawl.sql"] + "-- trailing comment\n")
    assert len(statements) == 2
    assert statements[1].startswith("CREATE TRIGGER") and statements[1].endswith("END;")
    with pytest.raises(MigrationError):
        split_sqlite_statements("CREATE TABLE x (a integer)")


def test_cli_migrate_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "cli.sqlite")
    assert cli.main(["--database-url", path]) == 0
    assert capsys.readouterr().out.startswith("applied ")
    assert cli.main(["--database-url", path]) == 0
    assert "up to date" in capsys.readouterr().out


def test_cli_default_url_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", str(tmp_path / "env.sqlite"))
    assert cli.main([]) == 0
    assert (tmp_path / "env.sqlite").exists()
    monkeypatch.delenv("RELAY_DATABASE_URL")
    monkeypatch.chdir(tmp_path)
    assert cli.main([]) == 0
    assert (tmp_path / "data" / "relay.sqlite").exists()
    capsys.readouterr()


def test_cli_reports_unreachable_database(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--database-url", "postgresql://postgres@127.0.0.1:1/test"]) == 1
    assert "relay migrate:" in capsys.readouterr().err


def test_migrations_ship_as_package_data_and_are_found_as_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``RELAY_MIGRATIONS_DIR`` the files come from the ``backfill.migrations`` package's
    resources, and pyproject.toml's package data covers every one of them (so ``pip install .``
    installs them; nothing is copied beside the packages by hand)."""
    monkeypatch.delenv("RELAY_MIGRATIONS_DIR", raising=False)
    here = Path(__file__).resolve().parents[2] / "backfill" / "migrations"
    assert Path(str(migrations_root())).resolve() == here
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["backfill"]
    for dialect in ("postgres", "sqlite"):
        on_disk = sorted(p.name for p in (here / dialect).glob("*.sql"))
        assert on_disk and [m.version for m in discover(dialect)] == [int(n[:4]) for n in on_disk]
        shipped = {p.name for g in globs for p in here.glob(g.removeprefix("migrations/")) if p.parent.name == dialect}
        assert shipped == set(on_disk), (dialect, set(on_disk) - shipped)
