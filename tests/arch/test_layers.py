"""The package layering: imports run one way, mst ← firehose ← backfill ← relay ← spark ← sim.

Every ``import``/``from … import`` in the six packages is parsed (including imports inside
functions); a module may import its own package or any package *below* it, never one above.
``bench/`` and ``tests/`` may import anything. ``sim`` (the PDS simulator, its own top-level
package) is test and demo tooling on top: it may use the relay's code, no serving module imports it. ``relay.cli`` dispatches subcommands by module name at run
time, which is a command-line entry, not an import edge, and is not parsed as one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["mst", "firehose", "backfill", "relay", "spark", "sim"]
SERVING = ORDER[:-1]
RANK = {name: i for i, name in enumerate(ORDER)}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend([(node.lineno, node.module)])
    return found


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def back_edges() -> list[str]:
    bad: list[str] = []
    for package in ORDER:
        for path in package_files(package):
            for line, module in imported_modules(path):
                top = module.split(".")[0]
                if top in RANK and RANK[top] > RANK[package]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_no_back_edges() -> None:
    assert back_edges() == []


def test_serving_code_does_not_import_the_simulator() -> None:
    bad = []
    for package in SERVING:
        for path in package_files(package):
            for line, module in imported_modules(path):
                if module == "sim" or module.startswith("sim."):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


@pytest.mark.parametrize("source,expected", [
    ("from relay.config import X\n", True),
    ("def f():\n    import spark.cli\n", True),
    ("from firehose.state import AccountState\n", False),
    ("from . import sibling\n", False),
])
def test_the_checker_sees_back_edges(tmp_path: Path, source: str, expected: bool) -> None:
    """The parser finds module-level and function-level imports (so the test above can fail)."""
    path = tmp_path / "m.py"
    path.write_text(source)
    tops = {module.split(".")[0] for _, module in imported_modules(path)}
    assert bool(tops & {"relay", "spark"}) is expected
