"""docs/architecture.md's dependency table is the package's real import graph between its parts (every import:
module level, inside functions, under ``TYPE_CHECKING``; ``from umalloc import X`` counts as an import of the
part that defines ``X``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import umalloc

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "umalloc"
DOC = REPO / "docs" / "architecture.md"
BEGIN, END = "<!-- dependency table: begin -->", "<!-- dependency table: end -->"


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _imports_by_part() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        here = parts[0] if parts[0] != "__init__" else ""
        if not here:
            continue  # the face itself: its export table names every part
        deps = out.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "umalloc":
                for a in node.names:
                    target = umalloc._EXPORTS.get(a.name, f"umalloc.{a.name}")
                    deps.add(_part(target))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("umalloc."):
                deps.add(_part(node.module))
            elif isinstance(node, ast.Import):
                deps.update(_part(a.name) for a in node.names if a.name.startswith("umalloc."))
        deps.discard(here)
        deps.discard("")
    return out


def _doc_table() -> dict[str, set[str]]:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC.name} has no dependency table between {BEGIN} and {END}"
    table: dict[str, set[str]] = {}
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        table[cells[0].strip("`").removesuffix("/").removesuffix(".py")] = set(re.findall(r"`([\w.]+?)/?`",
                                                                                         cells[1]))
    return table


def test_the_dependency_table_is_the_import_graph() -> None:
    real = {part: {d.removesuffix(".py") for d in deps} for part, deps in _imports_by_part().items()}
    doc = _doc_table()
    assert doc == real, "docs/architecture.md dependency table differs from the imports:\n" + "\n".join(
        f"  {p}: doc {sorted(doc.get(p, set()))} real {sorted(real.get(p, set()))}"
        for p in sorted(set(doc) | set(real)) if doc.get(p) != real.get(p))


def test_docstrings_point_inside_the_repo_and_comments_do_not_narrate_history() -> None:
    outside = re.compile(r"DESIGN\b|FAULTS\.md|shared/")
    history = re.compile(r"\b(used to|previously|as it was|formerly)\b", re.IGNORECASE)
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in ROOT.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line) or history.search(line)]
    assert not hits, "lines pointing outside the repo or narrating history:\n" + "\n".join(hits)


def test_the_notes_state_the_module_size_cap_the_layering_test_holds() -> None:
    from test_layering import MAX_MODULE_LINES

    assert f"at most {MAX_MODULE_LINES} lines (`MAX_MODULE_LINES`" in DOC.read_text(), (
        f"docs/architecture.md does not state the module-size cap {MAX_MODULE_LINES}")
