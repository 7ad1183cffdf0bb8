"""The drafter's sliding layers in `umalloc replay`: held only for a window (joined to the target's swa end, or in a
draft_swa end of the drafter's own window), every byte moved and verified, nothing left; the pages each SWA end
held per request against a count from the window, the page size and the positions alone."""

from __future__ import annotations

import json

import pytest

from umalloc_replay.report import check_report
from umalloc_replay.single.run import Replay, ReplayConfig

PS = 16
#: (prompt, output) tokens: past both windows (1,024 and 512), past the drafter's only, inside both.
REQUESTS = ((1500, 40), (700, 40), (100, 33))


def _trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": a, "output_length": b}) + "\n"
                         for i, (a, b) in enumerate(REQUESTS)))
    return p


def expected_peak_pages(prompt: int, output: int, window: int, page_size: int) -> int:
    """Most pages a request holds on an SWA end of ``window``: at ``n`` tokens it keeps the pages from the one
    holding token ``n - window`` (whole pages before it left the window), for every ``n`` the request reaches."""
    best = 0
    for n in range(prompt, prompt + output + 1):
        first_kept_token = max(0, n - window)
        best = max(best, -(-n // page_size) - first_kept_token // page_size)
    return best


class Observed(Replay):
    """Records, after every decode step (before finished requests free), the pages each request has bound on
    every SWA end, read through the allocator's own translation; checks the invariants after every step."""

    def _finish_requests(self) -> None:
        seen = self.__dict__.setdefault("seen", {})
        for rs in self.running:
            for end in self.swa:
                ps = self.dec_spec.end(end).page_size
                vp = self.table.vpages(rs.slot, ps, 0, -(-rs.seq_len // ps))
                bound = int((self.dec.translate_pages(vp, end, strict=False) != 0).sum())
                seen[(rs.rid, end)] = max(seen.get((rs.rid, end), 0), bound)
        super()._finish_requests()


@pytest.mark.parametrize("draft_sliding,windows", [
    ("swa", {"swa": 1024}),                        # the drafter's 22 layers held for the target's 1,024
    ("own", {"swa": 1024, "draft_swa": 512}),      # their own end at their own 512
    ("draft", {"swa": 1024}),                      # the whole drafter in the draft end (no window)
])
def test_drafter_sliding_layers_held_for_their_window(tmp_path, draft_sliding, windows):
    r = Observed(ReplayConfig(trace=str(_trace(tmp_path)), token_scale=1, draft_sliding=draft_sliding,
                              check_every=1, max_batch=2))
    assert {e.name: e.window_tokens for e in r.dec_spec.ends if e.name in windows} == windows
    assert sorted(r.swa) == sorted(windows)
    rep = r.run()
    assert check_report(rep) == [] and rep["ok"]
    assert rep["requests"]["completed"] == len(REQUESTS)
    assert rep["bytes"]["verified"] == rep["bytes"]["moved"] > 0 and rep["bytes"]["verified_final"] > 0
    assert rep["mismatches"]["pages"] == rep["mismatches"]["bytes"] == 0
    assert all(s.live_pages == 0 and s.pending_pages == 0 for s in r.dec.stats().values())
    assert r.dec.leases_active() == 0
    # one window tail vector per windowed end in the transfer plans
    names = {"swa": "swa_tail", "draft_swa": "swa_tail.draft_swa"}
    assert {names[e] for e in windows} <= set(rep["bytes"]["moved_by_vector"])
    for rid, (prompt, out) in enumerate(REQUESTS):
        for end, w in windows.items():
            assert r.seen[(rid, end)] == expected_peak_pages(prompt, out, w, PS), (rid, end)
    if draft_sliding == "own":   # past 512 tokens the drafter's window holds fewer pages than the target's
        assert r.seen[(0, "draft_swa")] == 512 // PS + 1 < r.seen[(0, "swa")] == 1024 // PS + 1


def test_expected_peak_pages_by_hand():
    # 1,500 tokens, window 1,024, 16-token pages: tokens 476.. kept, from page 29 (token 464): 94 - 29 = 65 pages
    assert expected_peak_pages(1500, 0, 1024, 16) == 65
    # 100 tokens inside the window: all 7 pages; 33 more tokens: cdiv(133, 16) = 9
    assert expected_peak_pages(100, 33, 1024, 16) == 9
    # 512 + 16 tokens at window 512: tokens 16.. kept, from page 1: 33 - 1 = 32; one token more opens page 33
    assert expected_peak_pages(528, 0, 512, 16) == 32 and expected_peak_pages(528, 1, 512, 16) == 33
