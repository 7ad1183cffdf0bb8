"""The fenced code blocks of ``README.md`` and ``docs/*.md``, for the tests that keep the documentation true.

A block opens with a fence naming its language (```` ```python ````, ```` ```bash ````, ```` ```console ````,
```` ```text ```` for output and drawings) and closes with a bare fence. A ``<!-- not-run: reason -->`` comment on
the last non-blank line before a block marks it as not run by ``tests/test_docs_blocks.py``; the reason says why
and where it runs instead.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: every documentation page whose blocks the tests read
DOC_FILES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
#: the languages a block may name; ``text`` holds output and drawings, never code
LANGUAGES = ("python", "bash", "console", "text")
#: shell block languages whose ``umalloc ...`` commands are parsed
SHELLS = ("bash", "console")

_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its file, the 1-based line of its opening fence, its language, its text (every line
    between the fences, each ending in a newline) and the reason of a ``not-run`` marker before it (``None``:
    no marker)."""

    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        """``FILE:LINE``, relative to the repository (a test id)."""
        return f"{_shown(self.path)}:{self.line}"


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` in file order; an unclosed fence raises ``ValueError`` naming its line."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(prev.strip())
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"{_shown(path)}:{start + 1}: a fence that never closes")
        code = "".join(line + "\n" for line in lines[start + 1:i])
        out.append(Block(path, start + 1, m.group(1), code, marker.group(1).strip() if marker else None))
        i += 1
    return out


def all_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md."""
    return [b for path in DOC_FILES for b in read_blocks(path)]


def python_block(containing: str) -> Block:
    """The one ```` ```python ```` block of README.md and docs/*.md whose code contains ``containing``."""
    found = [b for b in all_blocks() if b.lang == "python" and containing in b.code]
    assert len(found) == 1, f"expected one python block containing {containing!r}, found {[b.name for b in found]}"
    return found[0]


def shell_commands(block: Block) -> list[list[str]]:
    """The command lines of a shell block as argument lists: a console block's ``$ `` lines (its other lines
    are output), every non-blank line of a bash block; a trailing ``  # comment`` is dropped."""
    out = []
    for line in block.code.splitlines():
        if block.lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.strip():
            out.append(shlex.split(line, comments=True))
    return out


def umalloc_commands(subcommand: str) -> list[list[str]]:
    """The arguments after ``umalloc SUBCOMMAND`` of every such command in a shell block of README.md and
    docs/*.md."""
    return [cmd[2:] for b in all_blocks() if b.lang in SHELLS for cmd in shell_commands(b)
            if cmd[:2] == ["umalloc", subcommand]]
