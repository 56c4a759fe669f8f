"""The shape of the tree: imports go one way (attnbench → kernels) and no attnbench module imports itself back.

Read from the source (every import statement, function-level ones included), so a lazy import that closes a
circle is caught as well as a top-level one.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages=("attnbench", "kernels")) -> dict[str, set[str]]:
    """module → the modules of `packages` it imports (a package's own __init__ is not an edge from inside it)."""
    files = {_module_name(p): p for pkg in packages for p in (REPO / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from pkg import name` imports pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Every elementary circle among the modules whose name starts with `prefix` (each found once)."""
    found, nodes = set(), sorted(m for m in graph if m.startswith(prefix))

    def walk(start, node, path):
        for dep in graph[node]:
            if not dep.startswith(prefix):
                continue
            if dep == start:
                found.add(tuple(path))
            elif dep not in path and dep > start:     # each circle is reported from its smallest module
                walk(start, dep, path + [dep])

    for start in nodes:
        walk(start, start, [start])
    return [list(c) + [c[0]] for c in sorted(found)]


def test_the_graph_sees_imports():
    """The walker itself: top-level, function-level and relative imports are all edges."""
    graph = import_graph()
    assert "attnbench.store" in graph["attnbench.runs"]              # top level
    assert "attnbench.spotcheck" in graph["attnbench.runs"]          # inside run_progress
    assert "kernels.elsa.config" in graph["kernels.elsa.attention"]  # relative ("from .config import")
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}, "a.") == [["a.x", "a.y", "a.z", "a.x"]]


def test_no_import_circles_in_the_harness():
    assert cycles(import_graph(), "attnbench") == []


def test_kernels_never_import_the_harness():
    """kernels/ is usable without attnbench: not one import of it, even a lazy one."""
    graph = import_graph()
    bad = sorted(f"{m} → {d}" for m, deps in graph.items() if m.startswith("kernels")
                 for d in deps if d.startswith("attnbench"))
    assert bad == []
