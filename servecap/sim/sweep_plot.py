"""sweep.png: served rate and queue wait p50 (ms) against arrival rate, one line per configuration, with --interval
each point's band as a bar.

Every axis the sweep varied (pool, batch rows, backend, prefill policy, fleet: replicas and router) gets a visual
channel of its own, so no two configurations look alike: the axis with the most values gets colour, the next
markers, then line style, marker fill and line width (an axis of one value gets none). The legend, below the
axes, names each configuration in full and, in its title, which channel shows which axis; the figure's title
names the trace, its size, the seed(s) and the cost table.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from servecap.core.config import ServingConfig

from .sweep import ConfigResult

# (axis, its value for a configuration)
AXES: tuple[tuple[str, Callable[[ServingConfig], object]], ...] = (
    ("pool", lambda c: c.pool.gib), ("max batch", lambda c: c.max_batch), ("backend", lambda c: c.backend),
    ("prefill", lambda c: c.prefill), ("admission", lambda c: c.admission), ("prefix cache", lambda c: c.prefix_cache),
    ("fleet", lambda c: (c.replicas, c.router)))
MARKERS = "osD^vP*Xp"
LINESTYLES = ("-", "--", ":", "-.")
FILLS = ("full", "none", "left", "top")
WIDTHS = (1.2, 2.4, 3.6, 0.6)
CHANNELS = ("colour", "marker", "line", "fill", "width")


def channels(configs: list[ServingConfig]) -> dict[str, str]:
    """Axis -> channel for every axis with more than one value among `configs`, most values first."""
    count = {name: len(set(map(get, configs))) for name, get in AXES}
    varied = sorted((name for name, _ in AXES if count[name] > 1), key=lambda n: -count[n])  # stable on ties
    return dict(zip(varied, CHANNELS))


def _styles(configs: list[ServingConfig]) -> tuple[list[dict], dict[str, str]]:
    import matplotlib.pyplot as plt
    chosen = channels(configs)
    getters = dict(AXES)
    styles = [dict(color="C0", marker="o", linestyle="-", fillstyle="full", linewidth=1.2) for _ in configs]
    for axis, channel in chosen.items():
        values = list(dict.fromkeys(map(getters[axis], configs)))  # names in the order given (paged first), sizes
        order = sorted(values) if all(isinstance(v, (int, float)) for v in values) else values  # small to large
        for style, config in zip(styles, configs):
            k = order.index(getters[axis](config))
            if channel == "colour":
                style["color"] = plt.get_cmap("viridis")(k / max(1, len(order) - 1) * 0.9) if len(order) <= 8 else \
                    plt.get_cmap("tab20")(k % 20)
            elif channel == "marker":
                style["marker"] = MARKERS[k % len(MARKERS)]
            elif channel == "line":
                style["linestyle"] = LINESTYLES[k % len(LINESTYLES)]
            elif channel == "fill":
                style["fillstyle"] = FILLS[k % len(FILLS)]
            else:
                style["linewidth"] = WIDTHS[k % len(WIDTHS)]
    return styles, chosen


def title(meta: dict) -> str:
    """What the sweep ran on: the trace, its requests, the seed(s) and the cost table."""
    wl = meta.get("workload", {})
    if "trace_file" in wl:
        trace = f"trace {wl['trace_file']} (id {wl.get('trace_id')})"
    else:
        trace = f"seeded {wl.get('kind', 'poisson')} trace"
    n = f", n = {wl['n']}" if "n" in wl else ""
    seeds = wl.get("seeds")
    seed = f", seeds {seeds[0]}-{seeds[-1]}" if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)) else \
        f", seeds {','.join(map(str, seeds))}" if seeds else f", seed {wl['seed']}" if "seed" in wl else ""
    return f"{trace}{n}{seed}; cost table {meta.get('table', {}).get('id')}"


def plot(lines: list[tuple[list[ConfigResult], list[dict]]], path: Path, subtitle: str,
         level: float | None = None) -> None:
    """One line per configuration: (its results, one per seed; its bands rate by rate, servecap/sim/report.py: band_rows),
    the seeds' mean, shaded min to max with several seeds; the first seed's LEVEL% intervals (ConfigResult.bands)
    as bars where the sweep made them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (served, wait) = plt.subplots(1, 2, figsize=(13, 6))
    styles, chosen = _styles([group[0].config for group, _ in lines])
    top = 0.0
    scale = {"served_rate": 1.0, "queue_wait_p50": 1e3}  # queue wait in ms, as vLLM and the tables print it
    for (group, rows), style in zip(lines, styles):
        rate = [b["rate"] for b in rows]
        top = max(top, *rate)
        label = group[0].config.label if len(group) == 1 else \
            f"{group[0].config.label}: mean of {len(group)} seeds, shaded min-max"
        for ax, k in ((served, "served_rate"), (wait, "queue_wait_p50")):
            x = scale[k]
            ax.plot(rate, [b[f"{k}_mean"] * x for b in rows], markersize=5, label=label, **style)
            if len(group) > 1:
                ax.fill_between(rate, [b[f"{k}_min"] * x for b in rows], [b[f"{k}_max"] * x for b in rows],
                                color=style["color"], alpha=0.2, linewidth=0)
            banded = [(r, b[k]) for r, b in zip(group[0].rates, group[0].bands) if k in b]
            if banded:
                ax.vlines([r for r, _ in banded], [b["lo"] * x for _, b in banded], [b["hi"] * x for _, b in banded],
                          color=style["color"], alpha=0.45, linewidth=3)
    served.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle=":", label="served = arrival rate")
    if level is not None and any(group[0].bands for group, _ in lines):
        served.vlines([], [], [], color="grey", alpha=0.45, linewidth=3,
                      label=f"bar: the {level:g}% interval (trace seeds x cost model, run-to-run noise)")
    served.set(xlabel="arrival rate (requests/s)", ylabel="served rate (requests/s)",
               title="served rate: leaves the diagonal at capacity")
    wait.set(xlabel="arrival rate (requests/s)", ylabel="queue wait p50 (ms)",
             title="median queue wait: jumps past capacity")
    wait.set_yscale("symlog", linthresh=10)
    for ax in (served, wait):
        ax.grid(alpha=0.3)
    handles, labels = served.get_legend_handles_labels()
    key = ", ".join(f"{channel}: {axis}" for axis, channel in chosen.items())
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2 if len(labels) > 6 else 1,
               fontsize=8, frameon=False, title=key or None, title_fontsize=8)
    fig.suptitle("Where each configuration stops keeping up: the served rate flattens (or sags) and the queue wait "
                 f"explodes\n{subtitle}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # tight: the legend below the axes is inside the image
    plt.close(fig)
