"""The one PNG `python -m traces explain --png` draws: the split, the split by window, admission groups against
queue depth, and running rows, for one record or two side by side."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .explain import PARTS, Explanation
from .explain_report import PART_LABELS

COLORS = {"decode": "tab:blue", "prefill": "tab:green", "padding": "tab:red", "retire": "tab:purple",
          "untimed": "tab:gray", "idle": "0.85"}
HATCH = {0: "", 1: "//"}  # the second record's bars, where both share an axis


def plot(explanations: list[Explanation], names: list[str], path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # a file, never a window: this runs from a terminal or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ((ax_split, ax_win), (ax_groups, ax_rows)) = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_waste = ax_groups.twinx()
    n = len(explanations)
    for i, (e, name) in enumerate(zip(explanations, names)):
        left = 0.0
        for p in PARTS:
            share = e.split[p] / e.wall
            ax_split.barh(i, share, left=left, color=COLORS[p], label=PART_LABELS[p] if i == 0 else None)
            left += share
        w = e.windows
        length = (w["end"] - w["start"]).to_numpy()
        x = np.arange(len(w)) + (i - (n - 1) / 2) * 0.8 / n
        bottom = np.zeros(len(w))
        for p in PARTS:
            share = w[p].to_numpy() / length
            ax_win.bar(x, share, 0.8 / n, bottom=bottom, color=COLORS[p], hatch=HATCH[i], edgecolor="white", lw=0.3)
            bottom += share
        g = e.groups
        color = f"C{i}"
        ax_groups.plot(g["depth_lo"], g["size_mean"], "o-", color=color, label=f"{name}: mean group size")
        ax_waste.plot(g["depth_lo"], g["waste_p50"], "^--", color=color, label=f"{name}: padding waste p50")
        ax_rows.step(e.rows.index, e.rows.to_numpy(), where="mid", label=f"{name} (mean {e.figures['rows_mean']:.1f})")
    ax_split.set_yticks(range(n), names)
    ax_split.set_xlim(0, 1)
    ax_split.set_xlabel("share of the wall time (first arrival to last finish)")
    ax_split.set_title("Where the time goes")
    ax_split.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8, frameon=False)
    windows = min(len(e.windows) for e in explanations)
    ax_win.set_xticks(range(windows), [f"{k + 1}\n" + " | ".join(f"{e.windows['offered_rate'].iloc[k]:.3g}"
                                                                 for e in explanations) for k in range(windows)])
    ax_win.set_xlabel("window of the wall time, and its offered rate (req/s)")
    ax_win.set_ylabel("share of the window")
    ax_win.set_ylim(0, 1)
    ax_win.set_title("By window of the run" + (f" ({names[0]} plain, {names[1]} hatched)" if n > 1 else ""))
    ax_groups.set_xscale("log", base=2)
    ax_groups.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_groups.set_xlabel("queue depth at admission (bin's lower edge, requests)")
    ax_groups.set_ylabel("admission group size (requests)")
    ax_groups.set_title("Admission groups against queue depth")
    ax_waste.set_ylabel("padded positions per real prompt token (dashed)")
    handles = [h for ax in (ax_groups, ax_waste) for h in ax.get_legend_handles_labels()[0]]
    ax_groups.legend(handles=handles, fontsize=8, frameon=False, loc="upper left")
    ax_rows.set_xlabel("rows running")
    ax_rows.set_ylabel("share of the wall time")
    ax_rows.set_title("Rows running (time-weighted)")
    ax_rows.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
