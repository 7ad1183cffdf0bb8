"""In every multi-rank run MB moved exceeded MB verified with no word of why. Pages travel
whole: on an end the decode ranks do not split by DCP (the draft) a request's last page carries rows past its
end, which no rank reads. The table says so per vector, and the figure is checked here against that count made
from the prompt lengths alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from umalloc.testing import require_or_skip


@pytest.mark.backend
def test_moved_minus_verified_is_the_rows_of_whole_pages_past_each_request(tmp_path) -> None:
    require_or_skip("mooncake")
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-c", "from umalloc_replay.cli import app; app()", "replay", "--backend",
                          "mooncake", "--decode-dcp", "2", "--requests", "3", "--token-scale", "64", "--no-progress",
                          "--report", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    tot, lengths = rep["totals"], rep["requests"]["prompt_tokens"]
    decode = [r for r in rep["ranks"] if r["side"] == "decode"]
    ps = decode[0]["page_size"]
    # the draft's bytes per token, from what one rank verified: every decode rank holds every draft row
    per_token = decode[0]["verified_by_vector"]["draft"] // sum(lengths)
    past_end = sum(-(-L // ps) * ps - L for L in lengths)  # rows of each last page past the request's end
    assert past_end > 0, lengths
    assert tot["unread_by_vector"] == {"draft": len(decode) * past_end * per_token}
    assert tot["bytes"] - tot["verified_bytes"] == len(decode) * past_end * per_token
    caption = " ".join(res.stdout.split())
    assert "moved - verified = " in caption and "rows of whole pages past a request (never read)" in caption
