"""Wiring: every part is built complete, in order, by ``relay/wiring.py``; nothing starts as
``None`` under a type that says it cannot be (``x: Store = None  # type: ignore``), and no fault
injection is read from the environment by production code (the fault suite wraps the service from
the tests: ``tests/faults/faulty_relay.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WIRING = [ROOT / "relay" / "service.py", ROOT / "relay" / "wiring.py"]


def none_under_a_non_optional_type(path: Path) -> list[str]:
    """``name: T = None`` where ``T`` does not admit None (``X | None``, ``Optional[X]``, ``Any``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Constant)
                and node.value.value is None):
            annotation = ast.unparse(node.annotation)
            if "None" not in annotation and "Optional" not in annotation and annotation != "Any":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_starts_as_none_under_a_type_that_forbids_it() -> None:
    found = [line for path in WIRING for line in none_under_a_non_optional_type(path)]
    assert not found, f"None-then-assign in the wiring: {found}"


def test_the_wiring_needs_no_type_ignore() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}" for path in WIRING
             for n, line in enumerate(path.read_text().splitlines(), 1) if "type: ignore" in line]
    assert not found, f"type: ignore in the wiring: {found}"


def test_no_fault_injection_is_read_from_the_environment_in_production_code() -> None:
    found = [f"{path.relative_to(ROOT)}" for package in ("relay", "backfill", "firehose")
             for path in sorted((ROOT / package).rglob("*.py")) if "RELAY_FAULT" in path.read_text()]
    assert not found, f"fault-injection settings in production code: {found}"
