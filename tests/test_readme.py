"""The examples of README.md and docs/usage.md print what hand-computed values say they print (so the front page
and the usage page cannot rot; ``tests/test_docs_blocks.py`` runs every other python block of the docs)."""

from __future__ import annotations

import runpy

from doc_blocks import REPO, python_block


def _run(containing: str, tmp_path, capsys) -> list[str]:  # type: ignore[no-untyped-def]
    block = python_block(containing)
    script = tmp_path / "example.py"
    script.write_text(block.code)
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out.strip().splitlines()


def test_readme_python_example_runs(tmp_path, capsys):
    assert python_block("alloc.lease(").path == REPO / "README.md"
    out = _run("alloc.lease(", tmp_path, capsys)
    # the last line prints per-end (live, peak) pages: everything freed, and the 40 + 7 token prompts plus one
    # decode token each needed ceil(41/16) + ceil(8/16) = 3 + 1 = 4 pages at peak on every end
    assert out[-1] == "{'full': (0, 4), 'swa': (0, 4), 'draft': (0, 4)}"


def test_page_table_example_runs(tmp_path, capsys):
    out = _run("alloc.alloc_pages(", tmp_path, capsys)
    # by hand: virtual pages are minted from 1 in order, so row 0 gets 1 2 3 and row 1 gets 4 5; then vpage 1
    # leaves the swa end only and vpages 4, 5 leave every end: full and draft keep 3 pages, swa keeps 2
    assert out[-1] == ("[[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]] "
                       "{'full': 3, 'swa': 2, 'draft': 3}")


def test_request_table_example_runs(tmp_path, capsys):
    out = _run("RequestTable(alloc", tmp_path, capsys)
    # by hand, 16-token pages: request 0 = 40 + 1 tokens, truncated to 32 = pages A, B; the fork keeps 16 tokens
    # = page A; request 1 = 7 + 1 = 8 tokens = one page C. Freeing request 0 with cache=True leaves A (held by
    # the fork) and caches B (full, no holder). Held: A, C and the table's zero page = 3; cached: B = 1.
    assert out[-1] == "[16, 8] 3 1"
