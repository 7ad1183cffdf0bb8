"""The package's layering, read from the source: imports point one way and modules stay small.

Every import counts: module level, inside functions, under ``TYPE_CHECKING``. Layers, lowest first (a module may
import its own layer and the ones below it): errors and ids (the id validator, importing only errors),
translators, geometry, pool, leases, allocator, requests, transfer, backends, integrations, and
``umalloc.testing`` on top (imported by nothing in the package;
doctests use it); the replay application is the separate package ``umalloc_replay``. Backends and transfer know
plans and regions, not allocators: neither imports the pool, leases, allocator or requests layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import ROOT, assert_acyclic, import_graph

#: layer rank of each top-level part (lower may not import higher)
RANK = {"errors": 0, "ids": 0, "translators": 1, "geometry": 2, "pool": 3, "leases": 4, "allocator": 5, "requests": 6,
        "transfer": 7, "backends": 8, "integrations": 9, "testing": 11}
#: the allocation layers, which transfer and backends never import
ALLOCATION = {"pool", "leases", "allocator", "requests"}
#: the module-size rule: every ``.py`` of the library and the app holds one concept in at most this many lines
#: (blank lines, comments and docstrings included); a module that outgrows it is split by concept, not trimmed
MAX_MODULE_LINES = 860


def _part(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else ""


def test_no_import_cycle_anywhere_in_the_package() -> None:
    assert_acyclic(import_graph())


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for mod, deps in import_graph().items():
        here = _part(mod)
        if here not in RANK:  # umalloc/__init__.py: the lazy export table names every layer
            continue
        for d in deps:
            there = _part(d)
            if there == "testing" and here != "testing":
                wrong.append(f"{mod} -> {d} (test helpers stay out of the library proper)")
            elif there in RANK and RANK[there] > RANK[here]:
                wrong.append(f"{mod} -> {d}")
            elif here in ("transfer", "backends") and there in ALLOCATION:
                wrong.append(f"{mod} -> {d} ({here} knows plans and regions, not allocators)")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def _underscore_imports_across_folders(root: Path, package: str) -> list[str]:
    """``"<module> <- <module>.<name>"`` for every ``_``-prefixed name a module under ``root`` imports from a
    module of ``package`` that lives in another folder (a subfolder counts as another folder)."""
    files = {".".join((package, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    wrong = []
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in files and files[node.module].parent != path.parent:
                wrong += [f"{mod} <- {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    return wrong


def test_no_module_imports_an_underscore_name_from_another_folder() -> None:
    """A folder's private names (``_``-prefixed) stay inside it: e.g. the pool's meta columns are public names of
    ``pool.kernels.layout`` for the pool, and every layer above it reads the pool through its typed accessors
    (``Heap``, ``EndView``)."""
    wrong = _underscore_imports_across_folders(ROOT, "umalloc")
    assert not wrong, "underscore names imported across folders:\n" + "\n".join(sorted(wrong))


def test_the_folder_walk_catches_a_private_import(tmp_path: Path) -> None:
    """The walk itself: a ``_`` name from a subfolder's module is caught; one from the same folder is not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "low.py").write_text("_X = 1\nY = 2\n")
    (tmp_path / "same.py").write_text("_Z = 3\n")
    (tmp_path / "top.py").write_text("from pkg.sub.low import _X, Y\nfrom pkg.same import _Z\n")
    assert _underscore_imports_across_folders(tmp_path, "pkg") == ["pkg.top <- pkg.sub.low._X"]


def test_modules_stay_small() -> None:
    """The module-size rule (``MAX_MODULE_LINES``), over the library and the app."""
    roots = (ROOT, ROOT.parent / "umalloc_replay")   # the library and the app
    big = {str(p.relative_to(ROOT.parent)): n for root in roots for p in root.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_the_library_reads_nothing_from_the_team_folder() -> None:
    """The package must not depend on the team's ``shared/`` folder at run time (docs/faults.md is the catalogue)."""
    hits = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "shared/" in p.read_text()]
    assert not hits, f"modules naming shared/: {hits}"


def test_no_class_inherits_from_two_classes_of_the_library() -> None:
    """Composition over inheritance: a class may extend one of the library's classes (an error's family, a
    protocol), never mix several of them in."""
    trees = {p: ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}
    own = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    wrong = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                if len([b for b in bases if b in own]) > 1:
                    wrong.append(f"{path.relative_to(ROOT)}: {node.name}({', '.join(bases)})")
    assert len(own) > 50, f"the walk found {len(own)} classes"
    assert not wrong, "classes mixing several library classes:\n" + "\n".join(wrong)
