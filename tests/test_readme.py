"""The README's code example runs as written (so the front page cannot rot)."""

from __future__ import annotations

import pathlib
import re
import runpy

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no ```python example"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.strip().splitlines()
    # the last line prints per-end (live, peak) pages: everything freed, and the 40 + 7 token prompts plus one
    # decode token each needed ceil(41/16) + ceil(8/16) = 3 + 1 = 4 pages at peak on every end
    assert out[-1] == "{'full': (0, 4), 'swa': (0, 4), 'draft': (0, 4)}"


def test_readme_page_table_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README lost its page-table example"
    script = tmp_path / "readme_pages.py"
    script.write_text(blocks[1])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.strip().splitlines()
    # by hand: virtual pages are minted from 1 in order, so row 0 gets 1 2 3 and row 1 gets 4 5; then vpage 1
    # leaves the swa end only and vpages 4, 5 leave every end: full and draft keep 3 pages, swa keeps 2
    assert out[-1] == ("[[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]] "
                       "{'full': 3, 'swa': 2, 'draft': 3}")


def test_readme_request_table_example_runs(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its request-table example"
    script = tmp_path / "readme_requests.py"
    script.write_text(blocks[2])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.strip().splitlines()
    # by hand, 16-token pages: request 0 = 40 + 1 tokens, truncated to 32 = pages A, B; the fork keeps 16 tokens
    # = page A; request 1 = 7 + 1 = 8 tokens = one page C. Freeing request 0 with cache=True leaves A (held by
    # the fork) and caches B (full, no holder). Held: A, C and the table's zero page = 3; cached: B = 1.
    assert out[-1] == "[16, 8] 3 1"
