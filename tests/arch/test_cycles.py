"""No circle of files: the import graph of the six packages' modules has no cycle.

An edge is every ``import``/``from … import`` a module makes of another module of the project,
wherever it stands: at the top, inside a function, or under ``if TYPE_CHECKING:`` (a drawing of
the structure shows those too, and a type-only circle still means two files that cannot be
understood one without the other). ``from package import name`` is an edge to ``package.name``
when that is a module, else to the package. The one way out of a type-only circle is a narrower
type: the handlers read the service through ``relay.service_view.ServiceView``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.arch.test_layers import ORDER, ROOT


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` under the packages."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a project module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports (anywhere in its file)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            owners: list[str | None] = []
            if isinstance(node, ast.Import):
                owners = [_owner(alias.name, modules) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # each name is a submodule, or something the module ``base`` holds
                owners = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _owner(base, modules)
                          for alias in node.names]
            edges.update(owner for owner in owners if owner is not None and owner != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_circle_of_files() -> None:
    found = cycles(import_graph(module_files(ROOT, ORDER)))
    assert found == [], "import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_checker_sees_a_circle(tmp_path: Path) -> None:
    """A circle closed only by a function-local import and one closed only under TYPE_CHECKING."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("from pkg.c import y\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    (pkg / "f.py").write_text("from pkg import e, g\n")  # the second name closes the circle
    (pkg / "g.py").write_text("import pkg.f\n")
    found = sorted(cycles(import_graph(module_files(tmp_path, ["pkg"]))))
    assert found == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.f", "pkg.g"]]
