"""One route table: every HTTP and WebSocket endpoint of the relay is declared in ``relay/routes.py``.

Every module of the ``relay`` package is parsed; a call constructing a Starlette ``Route``,
``WebSocketRoute``, ``Mount`` or ``Host`` anywhere else is a second place a newcomer would have to
find (and a path that could be declared twice, as the probes once were).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "relay" / "routes.py"
ROUTE_CLASSES = {"Route", "WebSocketRoute", "Mount", "Host"}


def route_constructions(path: Path) -> list[int]:
    """Lines of ``path`` that call one of ``ROUTE_CLASSES`` (by bare or dotted name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ROUTE_CLASSES:
                lines.append(node.lineno)
    return lines


def test_routes_are_declared_only_in_the_route_table() -> None:
    elsewhere = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "relay").rglob("*.py"))
                 if path != TABLE for line in route_constructions(path)]
    assert not elsewhere, f"routes declared outside relay/routes.py: {elsewhere}"


def test_the_route_table_declares_the_probes_once() -> None:
    source = TABLE.read_text()
    for path in ('"/_health"', '"/_ready"', '"/metrics"'):
        assert source.count(path) == 1, f"{path} declared {source.count(path)} times in relay/routes.py"
