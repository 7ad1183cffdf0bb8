"""The replay's plot. Admission waits drew as one solid bar of ticks, a small arena read
"0.03 GB", the compaction curve shared an axis with requests done and flattened to 0, restores were not marked.
The figure is built from a report whose timeline is written here, so every drawn value is known."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=True)

import matplotlib.pyplot as plt  # noqa: E402

from umalloc_replay.plot import build_figure, plot_report  # noqa: E402

STEPS = list(range(1, 401))
WAITS = [[s, 1] for s in range(20, 380)]  # waiting at 360 consecutive steps: a solid bar of ticks before
RETRACT = [[50, 2], [120, 1]]
RESTORE = [[60, 1], [130, 2]]


def _report(decode_arena_bytes: int) -> dict:
    page = 1 << 20
    return {
        "config": {"trace": "/x/t.csv", "skip": 0, "requests": 40, "token_scale": 1, "model": "m", "page_size": 16,
                   "layout": "dynamic", "backend": "local", "prefill_arena_bytes": 2_500_000_000,
                   "decode_arena_bytes": decode_arena_bytes},
        "occupancy": {side: {"full": {"page_bytes": page}} for side in ("prefill", "decode")},
        "timeline": {
            "step": STEPS, "requests_done": [s // 10 for s in STEPS], "leases_active": [s % 3 for s in STEPS],
            "compaction_moves": [min(s, 37) for s in STEPS],  # 37 pages at most, beside 40 requests done
            "prefill_live_pages": {"full": [3] * len(STEPS)}, "decode_live_pages": {"full": [5] * len(STEPS)},
            "compaction_events": [[10, 0.1, "decode", 4]], "admission_wait_events": WAITS,
            "retraction_events": RETRACT, "restore_events": RESTORE,
        },
    }


def _lines(fig) -> dict[str, object]:
    return {ln.get_label(): (ax, ln) for ax in fig.axes for ln in ax.get_lines()}


def test_waits_are_a_cumulative_curve_not_a_bar_of_ticks() -> None:
    fig = build_figure(_report(35_651_584))
    try:
        lines = _lines(fig)
        assert not [k for k in lines if "admission waited" in k]  # no tick row
        _ax, waits = lines["admission waits (cumulative steps)"]
        y = list(waits.get_ydata())
        # by hand: no wait before step 20, one per step from 20 to 379, none after
        assert y[18] == 0 and y[19] == 1 and y[378] == 360 and y[-1] == 360
    finally:
        plt.close(fig)


def test_a_small_arena_is_drawn_in_mb_and_a_large_one_in_gb() -> None:
    fig = build_figure(_report(35_651_584))
    try:
        decode, prefill = fig.axes[0], fig.axes[1]
        assert decode.get_ylabel() == "decode live MB" and prefill.get_ylabel() == "prefill live GB"
        labels = [ln.get_label() for ln in decode.get_lines()]
        assert "arena 35.7 MB" in labels, labels  # 35,651,584 B
        assert "arena 2.5 GB" in [ln.get_label() for ln in prefill.get_lines()]
        stack = decode.collections[0].get_paths()[0].vertices[:, 1]
        assert abs(max(stack) - 5 * (1 << 20) / 1e6) < 1e-9  # 5 live 1 MiB pages, in MB
    finally:
        plt.close(fig)


def test_compaction_moves_have_an_axis_of_their_own_and_restores_are_marked() -> None:
    fig = build_figure(_report(35_651_584))
    try:
        lines = _lines(fig)
        comp_ax, comp = lines["compaction moves (cumulative pages)"]
        done_ax, _ = lines["requests done"]
        assert comp_ax is not done_ax and comp_ax.get_shared_y_axes().get_siblings(comp_ax) == [comp_ax]
        lo, hi = comp_ax.get_ylim()
        assert hi <= 37 * 1.2  # scaled to its own data (37 pages), not to another series
        _ax, restores = lines["restore (3 requests)"]
        assert list(restores.get_xdata()) == [60, 130]
        _ax, retracts = lines["retraction (3 requests)"]
        assert list(retracts.get_xdata()) == [50, 120]
    finally:
        plt.close(fig)


def test_every_suffix_writes_its_format(tmp_path) -> None:
    heads = {".png": b"\\x89PNG", ".pdf": b"%PDF", ".svg": b"<?xml"}
    for suffix, head in heads.items():
        out = plot_report(_report(2_000_000_000), tmp_path / f"p{suffix}")
        assert out.read_bytes().startswith(head.decode("unicode_escape").encode("latin-1")), suffix
