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
