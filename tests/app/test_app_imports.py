"""The replay application (``umalloc_replay``) uses the library only through public names.

Every import in the application's source counts (module level, inside functions, under ``TYPE_CHECKING``): a
``umalloc`` name comes as ``from umalloc import NAME`` with ``NAME`` in ``umalloc.__all__``, or as ``from
umalloc.<module> import NAME`` with ``NAME`` in that module's ``__all__`` (the app imports what it needs from the
subpackages; ``umalloc.__all__`` holds what an engine or transfer adapter needs); a module or name with a leading
underscore, a name a module does not export and a bare ``import umalloc.x`` are refused. The library never imports
the application.
"""

from __future__ import annotations

import ast
import importlib
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
                if not names or any(part.startswith("_") for part in module.split(".")):
                    wrong.append(f"{where}: {module} is not a public module (from umalloc.<module> import NAME)")
                    continue
                mod = importlib.import_module(module)
                exported = set(getattr(mod, "__all__", [n for n in vars(mod) if not n.startswith("_")]))
                wrong += [f"{where}: {module}.{n} is not exported" for n in names if n not in exported]
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
    """The walk itself: a module's non-exported name, a non-exported name of umalloc and a bare ``import umalloc.x``
    are each caught; exported names of umalloc and of a submodule pass."""
    (tmp_path / "bad.py").write_text("from umalloc.allocator.facade import _plain\n"
                                     "def f():\n    from umalloc import _EXPORTS\n    import umalloc.backends\n"
                                     "from umalloc import Arena\nfrom umalloc.geometry.presets import PRESETS\n")
    wrong = _non_public_uses(tmp_path)
    assert [w.split(": ", 1)[0].rsplit(":", 1)[1] for w in wrong] == ["1", "3", "4"], wrong


def test_the_library_never_imports_the_app() -> None:
    hits = [f"{p.relative_to(ROOT)}:{line}" for p in LIB.rglob("*.py") for line, module, _ in _imports(p)
            if module.split(".")[0] == "umalloc_replay"]
    assert not hits, hits
