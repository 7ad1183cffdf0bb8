"""The replay's PNG: occupancy of every end of both arenas over time, compaction events, lease counts.

* Three panels sharing the time axis (scheduler steps): the decode arena's ends as stacked areas of live bytes
  (each end in its own page size, so the stack is the arena's byte occupancy) with its capacity line; the
  prefill arena the same way; then active leases, cumulative compaction moves and requests done.
* Compaction events are drawn as ticks on the arena panel of the side that moved pages.
* Headless: matplotlib's ``Agg`` backend; nothing is shown, one file is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def plot_report(report: Mapping, path: str | Path) -> Path:
    """Write the plot of a replay report (its ``timeline``) to ``path`` (PNG). Returns the path.

    Raises:
        KeyError: the report lacks a timeline (not a replay report).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tl = report["timeline"]
    steps = tl["step"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, height_ratios=[3, 2, 2])
    cfg = report["config"]
    fig.suptitle(f"umalloc replay: {cfg['model']}, page_size {cfg['page_size']}, backend {cfg['backend']}, "
                 f"{report['requests']['total']} requests (token scale {cfg['token_scale']})")
    for ax, side in ((axes[0], "decode"), (axes[1], "prefill")):
        occ = report["occupancy"][side]
        live = tl[f"{side}_live_pages"]
        names = list(live)
        series = [[p * occ[e]["page_bytes"] / 1e9 for p in live[e]] for e in names]
        if steps and series:
            ax.stackplot(steps, *series, labels=[f"{e} ({occ[e]['page_bytes'] / 2**20:.2f} MiB pages)"
                                                 for e in names], alpha=0.8)
        cap = cfg[f"{side}_arena_bytes"] / 1e9
        ax.axhline(cap, color="black", lw=1, ls="--", label=f"arena {cap:.2f} GB")
        ev = [e for e in tl["compaction_events"] if e[2] == side]
        if ev:
            ax.plot([e[0] for e in ev], [cap * 1.02] * len(ev), "|", color="red", ms=8,
                    label=f"compaction ({len(ev)} events)")
        ax.set_ylabel(f"{side} live GB")
        ax.set_ylim(0, cap * 1.08)
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2]
    ax.plot(steps, tl["leases_active"], label="leases active", color="tab:purple")
    ax.set_ylabel("leases")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # leases are counts
    ax2 = ax.twinx()
    ax2.plot(steps, tl["compaction_moves"], label="compaction moves (cumulative pages)", color="tab:red")
    ax2.plot(steps, tl["requests_done"], label="requests done", color="tab:green")
    ax2.set_ylabel("pages / requests")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_xlabel("scheduler step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["plot_report"]
