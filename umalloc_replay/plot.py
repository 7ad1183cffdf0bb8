"""The replay's PNG: occupancy of every end of both arenas over time, compaction events, lease counts.

* Three panels sharing the time axis (scheduler steps): the decode arena's ends as stacked areas of live bytes
  (each end in its own page size, so the stack is the arena's byte occupancy) with its capacity line; the
  prefill arena the same way; then active leases, cumulative compaction moves and requests done.
* Compaction events are drawn as ticks above the arena line of the side that moved pages; on the decode panel
  two more rows of ticks mark the steps in which admission waited for memory and those in which requests were
  retracted, so an arena that looks empty while nothing progresses shows why.
* Legends sit to the right of the panels, never over the data; counts read "1 event", "2 events".
* Headless: matplotlib's ``Agg`` backend; nothing is shown, one file is written, in the format its suffix names
  (``.png``, ``.pdf``, ``.svg``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from umalloc_replay.report import report_title


def plural(n: int, word: str) -> str:
    """``"1 event"``, ``"2 events"``.

    >>> plural(1, "event"), plural(0, "step"), plural(3, "retraction")
    ('1 event', '0 steps', '3 retractions')
    """
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def plot_report(report: Mapping, path: str | Path) -> Path:
    """Write the plot of a replay report (its ``timeline``) to ``path`` (format from its suffix, PNG without
    one). Returns the path.

    Raises:
        KeyError: the report lacks a timeline (not a replay report).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tl = report["timeline"]
    steps = tl["step"]
    fig, axes = plt.subplots(3, 1, figsize=(14, 9), sharex=True, height_ratios=[3, 2, 2])
    cfg = report["config"]
    fig.suptitle(report_title(report), fontsize=10)
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
            ax.plot([e[0] for e in ev], [cap * 1.03] * len(ev), "|", color="red", ms=8,
                    label=f"compaction ({plural(len(ev), 'event')})")
        if side == "decode":
            waits = tl["admission_wait_events"]
            if waits:
                ax.plot([e[0] for e in waits], [cap * 1.07] * len(waits), "|", color="tab:orange", ms=8,
                        label=f"admission waited ({plural(len(waits), 'step')})")
            retr = tl["retraction_events"]
            if retr:
                ax.plot([e[0] for e in retr], [cap * 1.11] * len(retr), "v", color="tab:brown", ms=5,
                        label=f"retraction ({plural(sum(e[1] for e in retr), 'request')})")
        ax.set_ylabel(f"{side} live GB")
        ax.set_ylim(0, cap * 1.15)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
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
    ax2.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", bbox_to_anchor=(1.06, 1.0),
               fontsize=8, borderaxespad=0)
    ax.set_xlabel("scheduler step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, format=(out.suffix[1:] or "png").lower(), bbox_inches="tight")
    plt.close(fig)
    return out


__all__ = ["plot_report", "plural"]
