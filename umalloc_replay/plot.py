"""The replay's plot: occupancy of every end of both arenas over time, compaction events, leases, admission.

* Four panels sharing the time axis (scheduler steps): the decode arena's ends as stacked areas of live bytes
  (each end in its own page size, so the stack is the arena's byte occupancy) with its capacity line; the
  prefill arena the same way; active leases with requests done; cumulative compaction moves (pages) with the
  cumulative steps in which admission waited, each on its own axis so neither flattens the other.
* Bytes in GB, or in MB for an arena under 1 GB (:func:`byte_unit`), so a small arena never reads "0.03 GB".
* Compaction events are ticks above the arena line of the side that moved pages; on the decode panel
  retractions (down triangles) and restores (up triangles) are marked at their steps.
* Legends sit to the right of the panels, never over the data; counts read "1 event", "2 events".
* Headless: matplotlib's ``Agg`` backend; nothing is shown, one file is written, in the format its suffix names
  (``.png``, ``.pdf``, ``.svg``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from umalloc_replay.report import report_title


def plural(n: int, word: str) -> str:
    """``"1 event"``, ``"2 events"``.

    >>> plural(1, "event"), plural(0, "step"), plural(3, "retraction")
    ('1 event', '0 steps', '3 retractions')
    """
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def byte_unit(nbytes: float) -> tuple[str, float]:
    """``("GB", 1e9)`` for at least 1 GB, else ``("MB", 1e6)``: the unit an arena of ``nbytes`` is drawn in.

    >>> byte_unit(35_651_584), byte_unit(2.5e9)
    (('MB', 1000000.0), ('GB', 1000000000.0))
    """
    return ("GB", 1e9) if nbytes >= 1e9 else ("MB", 1e6)


def cumulative_steps(events: list, steps: list[int]) -> list[int]:
    """For every point of ``steps``, how many ``[step, count]`` events happened at or before it (each event is
    one step in which something happened). O(points + events).

    >>> cumulative_steps([[2, 5], [3, 1], [7, 2]], [1, 2, 5, 9])
    [0, 1, 2, 3]
    """
    out, n, i = [], 0, 0
    at = sorted(e[0] for e in events)
    for s in steps:
        while i < len(at) and at[i] <= s:
            n, i = n + 1, i + 1
        out.append(n)
    return out


def build_figure(report: Mapping) -> Any:
    """The matplotlib ``Figure`` of a replay report (see the module notes); the caller saves and closes it.

    Raises:
        KeyError: the report lacks a timeline (not a replay report).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tl = report["timeline"]
    steps = tl["step"]
    fig, axes = plt.subplots(4, 1, figsize=(14, 11), sharex=True, height_ratios=[3, 2, 1.5, 1.5])
    cfg = report["config"]
    fig.suptitle(report_title(report), fontsize=10)
    for ax, side in ((axes[0], "decode"), (axes[1], "prefill")):
        occ = report["occupancy"][side]
        live = tl[f"{side}_live_pages"]
        names = list(live)
        unit, div = byte_unit(cfg[f"{side}_arena_bytes"])
        series = [[p * occ[e]["page_bytes"] / div for p in live[e]] for e in names]
        if steps and series:
            ax.stackplot(steps, *series, labels=[f"{e} ({occ[e]['page_bytes'] / 2**20:.2f} MiB pages)"
                                                 for e in names], alpha=0.8)
        cap = cfg[f"{side}_arena_bytes"] / div
        ax.axhline(cap, color="black", lw=1, ls="--", label=f"arena {cap:,.1f} {unit}")
        ev = [e for e in tl["compaction_events"] if e[2] == side]
        if ev:
            ax.plot([e[0] for e in ev], [cap * 1.03] * len(ev), "|", color="red", ms=8,
                    label=f"compaction ({plural(len(ev), 'event')})")
        if side == "decode":
            for key, y, marker, color, word in (("retraction_events", 1.07, "v", "tab:brown", "retraction"),
                                                ("restore_events", 1.11, "^", "tab:cyan", "restore")):
                marks = tl.get(key, [])
                if marks:
                    ax.plot([e[0] for e in marks], [cap * y] * len(marks), marker, color=color, ms=5, ls="none",
                            label=f"{word} ({plural(sum(e[1] for e in marks), 'request')})")
        ax.set_ylabel(f"{side} live {unit}")
        ax.set_ylim(0, cap * 1.15)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
        ax.grid(alpha=0.3)
    pairs = ((axes[2], ("leases active", tl["leases_active"], "tab:purple", "leases"),
              ("requests done", tl["requests_done"], "tab:green", "requests")),
             (axes[3], ("compaction moves (cumulative pages)", tl["compaction_moves"], "tab:red", "pages"),
              ("admission waits (cumulative steps)", cumulative_steps(tl["admission_wait_events"], steps),
               "tab:orange", "steps")))
    for ax, (l_label, l_data, l_color, l_unit), (r_label, r_data, r_color, r_unit) in pairs:
        ax.plot(steps, l_data, label=l_label, color=l_color)
        ax.set_ylabel(l_unit)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
        ax2 = ax.twinx()
        ax2.plot(steps, r_data, label=r_label, color=r_color)
        ax2.set_ylabel(r_unit)
        ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
        h1, h2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
        ax2.legend(h1[0] + h2[0], h1[1] + h2[1], loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8,
                   borderaxespad=0)
        ax.grid(alpha=0.3)
    axes[3].set_xlabel("scheduler step")
    fig.tight_layout()
    return fig


def plot_report(report: Mapping, path: str | Path) -> Path:
    """Write the plot of a replay report (its ``timeline``) to ``path`` (format from its suffix, PNG without
    one). Returns the path.

    Raises:
        KeyError: the report lacks a timeline (not a replay report).
    """
    import matplotlib.pyplot as plt

    fig = build_figure(report)
    out = Path(path)
    fig.savefig(out, dpi=110, format=(out.suffix[1:] or "png").lower(), bbox_inches="tight")
    plt.close(fig)
    return out


__all__ = ["build_figure", "byte_unit", "cumulative_steps", "plot_report", "plural"]
