"""The package's import graph, read from the source for the layering tests: every import counts (module level,
inside functions, under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "umalloc"


def module_name(path: Path) -> str:
    """``umalloc/pool/heap.py`` -> ``umalloc.pool.heap``; a package's ``__init__.py`` is the package."""
    return ".".join(("umalloc", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def import_graph(parts: tuple[str, ...] | None = None) -> dict[str, set[str]]:
    """Module -> the ``umalloc`` modules it imports (``from umalloc import X`` counts as ``umalloc.X`` where that
    is a module; a module's import of itself is dropped). With ``parts`` (top-level folders such as ``"pool"``):
    only their modules, and of each only the imports among them."""
    modules = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    if parts is not None:
        keep = tuple(f"umalloc.{part}" for part in parts)
        modules = {m: p for m, p in modules.items() if m == keep or m.startswith(keep)}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "umalloc":
                    deps.update(f"umalloc.{a.name}" for a in node.names if f"umalloc.{a.name}" in modules)
                elif node.module.startswith("umalloc."):
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("umalloc."))
        deps.discard(mod)
        if parts is not None:
            deps.intersection_update(modules)
    return graph


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    """AssertionError naming the first import cycle of ``graph`` (modules visited in sorted order)."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, f"import cycle: {' -> '.join([*path, m])}"
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
