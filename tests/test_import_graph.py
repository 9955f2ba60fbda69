"""The package's import graph has no cycle: every ``import`` between gqa's modules counts, at the top of a module or
inside a function (a lazy import still ties the two modules together), and so does the ``__init__`` of every package
an import enters (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first); not those under ``if
TYPE_CHECKING:`` (types only, never run). A cycle is reported with its modules, so the layer that imports upwards is
easy to find."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gqa"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The gqa modules ``path`` imports (``from .x import y`` names module ``x.y`` where that is a module)."""
    name, is_package = module_name(path), path.name == "__init__.py"
    type_only: set[int] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
                # importing a.b.c runs the __init__ of a and a.b first, unless the importer is inside them already
                package = target.rsplit(".", 1)[0] if "." in target else ""
                while package and not name.startswith(package + ".") and package != name:
                    found.add(package)
                    package = package.rsplit(".", 1)[0] if "." in package else ""
                break
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def test_the_package_has_no_import_cycle():
    assert cycles(package_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    graph = package_graph()
    assert "gqa.serve.scheduler" in graph["gqa.serve.engine"]  # the graph sees the package's real imports
    assert "gqa.models.llama" not in graph["gqa.decoding.generate"]  # ... and not the TYPE_CHECKING ones
