"""The replay application (``umalloc_replay``) uses the library only through its public face.

Every import in the application's source counts (module level, inside functions, under ``TYPE_CHECKING``): a
``umalloc`` name must come as ``from umalloc import NAME`` with ``NAME`` in ``umalloc.__all__``; a submodule
import (``from umalloc.core.allocator import ...``, ``import umalloc.backends``) is refused. The library never
imports the application.
"""

from __future__ import annotations

import ast
from pathlib import Path

import umalloc

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "umalloc_replay"
LIB = ROOT / "umalloc"


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import statement in ``path`` (``names`` empty for ``import X``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
    return out


def _non_public_uses(root: Path) -> list[str]:
    public = set(umalloc.__all__) | {"__version__"}
    wrong = []
    for path in sorted(root.rglob("*.py")):
        for line, module, names in _imports(path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if module == "umalloc":
                wrong += [f"{where}: umalloc.{n} is not exported" for n in names if n not in public]
                if not names:
                    wrong.append(f"{where}: import umalloc (use from umalloc import NAME)")
            elif module.startswith("umalloc."):
                wrong.append(f"{where}: {module} is not the public face (from umalloc import NAME)")
    return wrong


def test_the_app_imports_only_names_exported_by_umalloc() -> None:
    files = list(APP.rglob("*.py"))
    assert len(files) >= 15, f"the walk found {len(files)} modules under {APP}"
    wrong = _non_public_uses(APP)
    assert not wrong, "the replay app reaches past umalloc's public face:\n" + "\n".join(wrong)


def test_every_exported_name_resolves() -> None:
    """The export table names real objects (a typo would pass the walk above and fail at run time)."""
    missing = [n for n in umalloc.__all__ if getattr(umalloc, n, None) is None and n != "TOMBSTONE"]
    assert not missing, missing


def test_the_walk_refuses_a_private_import(tmp_path: Path) -> None:
    """The walk itself: a submodule import, a non-exported name and a bare ``import umalloc.x`` are each caught."""
    (tmp_path / "bad.py").write_text("from umalloc.core.allocator import MultiEndedAllocator\n"
                                     "def f():\n    from umalloc import _EXPORTS\n    import umalloc.backends\n"
                                     "from umalloc import Arena\n")
    wrong = _non_public_uses(tmp_path)
    assert [w.split(": ", 1)[0].rsplit(":", 1)[1] for w in wrong] == ["1", "3", "4"], wrong


def test_the_library_never_imports_the_app() -> None:
    hits = [f"{p.relative_to(ROOT)}:{line}" for p in LIB.rglob("*.py") for line, module, _ in _imports(p)
            if module.split(".")[0] == "umalloc_replay"]
    assert not hits, hits
