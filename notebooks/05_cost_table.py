# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · The cost table
#
# The simulator knows one thing about the GPU: how long a step takes. The cost table holds that, measured
# on the engine in closed runs (calibrate/), as points with a median and a p10-p90 spread, plus the fitted
# model that serves every shape between them (servecap/costs/model.py):
#
# - **prefill** of one step: a smooth surface over its rows, the positions it computes and their attention
#   work (a launch-bound floor for small steps, GPU work linear in the positions plus attention's square for
#   large ones). A padded group of w prompts padded to n is w rows of n positions; packed and chunked steps
#   are priced by the same surface from their own shapes (servecap/costs/shapes.py);
# - **decode** of one step: per row count, a plane in the K/V tokens of all rows and the longest row's;
# - **held-out accuracy**: the fitted model against shapes the fit never saw;
# - **stationarity**: each shape's first run against its repeats, which says whether a step's cost depended
#   on its shape alone.
#
# Data: the table in `SERVECAP_TABLE` (default `servecap/costs/data/h200.json`). Figures: `FIGURES_DIR`
# (default `notebooks/figures`).

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from servecap.costs.fit import point_shape
from servecap.costs.model import CostModel, ExtrapolationWarning
from servecap.costs.shapes import PrefillShape

table, table_file = S.load_table(allow_nonstationary=True)  # describing a table, its failed check included
cost = CostModel(table)
prefill = pd.DataFrame(table.prefill_points())
decode = pd.concat([pd.DataFrame(table.raw["decode"][b]["points"]).assign(backend=b) for b in table.backends],
                   ignore_index=True)
print(f"{len(prefill)} prefill points (" + ", ".join(f"{(prefill.policy == p).sum()} {p}" for p in table.policies)
      + "), " + ", ".join(f"{(decode.backend == b).sum()} {b} decode points" for b in table.backends))
print(f"retirement overhead: {table.retire_s * 1e3:.3f} ms per retired row")


def quiet(fn, *args):
    """The cost model at a shape, without its warning for shapes past the measured edge."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        return fn(*args)


prefill["fitted_s"] = [quiet(cost.prefill, point_shape({k: v for k, v in p.items() if v == v}))
                       for p in prefill.to_dict("records")]  # v == v: a version-1 point has no sequences (NaN)
prefill["residual"] = prefill.median_s / prefill.fitted_s - 1
padded = prefill[prefill.policy == "padded"].assign(width=lambda d: d["rows"],
                                                   padded_len=lambda d: d["tokens"] // d["rows"])
others = prefill[prefill.policy != "padded"]


# %% [markdown]
# ## Prefill: one padded admission group, by width and padded length
#
# Left: the step time, measured and fitted. Middle: the same divided by the group's padded positions
# (width x padded length), the price of one padded position: high where the launch floor dominates, lowest
# where the GPU is busy, rising again where attention's square takes over. Right: how far each measured
# median sits from the fitted surface, with the table's packed and chunked steps (if it measured them) at the
# positions they computed.

# %%
widths = sorted(padded.width.unique())
colors = dict(zip(widths, plt.cm.viridis(np.linspace(0, 0.9, len(widths)))))
dense = np.geomspace(padded.padded_len.min(), padded.padded_len.max(), 80).round().astype(int)

fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
for w in widths:
    pts = padded[padded.width == w].sort_values("padded_len")
    fitted = np.array([quiet(cost.prefill, PrefillShape.padded(int(w), int(n))) for n in dense])
    yerr = np.array([pts.median_s - pts.p10_s, pts.p90_s - pts.median_s]) * 1e3
    ax.errorbar(pts.padded_len, pts.median_s * 1e3, yerr=yerr, fmt="o", ms=4, capsize=2, color=colors[w],
                mec="black", mew=0.3, label=f"width {w}")
    ax.plot(dense, fitted * 1e3, color=colors[w], lw=1.2)
    ax2.plot(pts.padded_len, pts.median_s / (w * pts.padded_len) * 1e6, "o", ms=4, color=colors[w], mec="black",
             mew=0.3)
    ax2.plot(dense, fitted / (w * dense) * 1e6, color=colors[w], lw=1.2)
    ax3.plot(pts.padded_len, pts.residual * 100, "o-", ms=4, lw=0.8, color=colors[w])
for policy, g in others.groupby("policy"):
    ax3.plot(g.attn / g.tokens, g.residual * 100, "D", ms=4, color=S.policy_color(policy), mec="black", mew=0.3,
             label=f"{policy} steps ({len(g)})")
for a in (ax, ax2, ax3):
    a.set_xscale("log", base=2)
    S.plain_ticks(a, "x")
for a in (ax, ax2):
    a.set_xlabel("padded prompt length (tokens)")
    a.set_yscale("log")
    S.plain_ticks(a, "y")
ax3.set_xlabel("attention span per position (tokens; a padded group's padded length)")
ax.set_ylabel("prefill step time (ms)")
ax.set_title("Padded groups: measured median (p10-p90 bars), fitted (lines)")
ax.legend(title="group width (rows)", ncol=2)
ax2.set_ylabel("time per padded position (µs)")
ax2.set_title("Per padded position: step time / (width x length)")
ax3.axhline(0, color="black", lw=0.8)
span = max(1.0, float(prefill.residual.abs().max() * 100) * 1.15)
ax3.set_ylim(-span, span)
ax3.set_ylabel("measured / fitted - 1 (%)")
ax3.set_title("Fit residual at every measured point")
if len(others):
    ax3.legend(loc="lower left")
fig.suptitle(f"Prefill cost, {table.device_name} ({S.table_label(table)})")
big = padded.sort_values(["width", "padded_len"]).iloc[-1]
worst = padded.loc[padded.residual.abs().idxmax()]
extra = "".join(f"; {p} steps: median |residual| {g.residual.abs().median():.1%}" for p, g in others.groupby("policy"))
S.save(fig, "05_prefill",
       f"The widest group ({int(big.width)} x {int(big.padded_len)}) costs {big.median_s * 1e3:.0f} ms and the "
       f"smallest {padded.median_s.min() * 1e3:.1f} ms; padded groups: median |residual| "
       f"{padded.residual.abs().median():.1%}, {worst.residual:+.1%} at worst ({int(worst.width)} x "
       f"{int(worst.padded_len)}){extra}.")

# %% [markdown]
# ## Decode: one step, by K/V tokens read and row count
#
# The model prices a step by the K/V tokens of all its rows and by its longest row. The lines are batches of
# equal rows (every row as long as the longest); a measured point with mixed lengths sits off its line, and
# the cross marks the model at that point's own shape. `paged` reads each row at its true length; `padded`
# reads every row at the longest row's length, so the same batch reads (and costs) more. The bottom row
# shows how far each measured median is from the model at its shape.

# %%
backends = table.backends
rows_all = sorted(decode["rows"].unique())
shown = [r for r in rows_all if r in (1, 2, 4, 8, 16, 24, 32)] or rows_all
rcolors = dict(zip(shown, plt.cm.plasma(np.linspace(0, 0.85, len(shown)))))
decode["fitted_s"] = [float(quiet(cost.decode, b, int(r), int(t), int(m))) for b, r, t, m in
                      zip(decode.backend, decode["rows"], decode.kv_tokens, decode.kv_max)]
decode["residual"] = decode.median_s / decode.fitted_s - 1
fig, axes = plt.subplots(2, len(backends), figsize=(6.5 * len(backends), 7.4), squeeze=False,
                         gridspec_kw={"height_ratios": [3, 1.3]}, sharex="col")
for j, b in enumerate(backends):
    ax, res = axes[0, j], axes[1, j]
    d = decode[decode.backend == b]
    for r in shown:
        pts = d[d["rows"] == r].sort_values("kv_read")
        if pts.empty:
            continue
        # equal rows, all as long as this (whole tokens, as the cost model takes them)
        longest = np.unique(np.round(np.geomspace(max(pts.kv_max.min(), 1), pts.kv_max.max(), 50)).astype(int))
        ax.plot(r * longest, np.asarray(quiet(cost.decode, b, int(r), r * longest, longest)) * 1e3, color=rcolors[r],
                lw=1.2)
        ax.errorbar(pts.kv_read, pts.median_s * 1e3, yerr=[(pts.median_s - pts.p10_s) * 1e3,
                                                           (pts.p90_s - pts.median_s) * 1e3],
                    fmt="o", ms=3.5, capsize=2, color=rcolors[r], label=f"{r} row{'s' if r > 1 else ''}")
        ax.plot(pts.kv_read, pts.fitted_s * 1e3, "x", ms=5, color=rcolors[r])
    ax.plot([], [], "x", color="grey", label="model at the point's shape")
    ax.set_xscale("log")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(f"{b}: measured median (p10-p90), model for equal rows (lines)")
    ax.legend(ncol=2, title="rows shown")
    res.scatter(d.kv_read, d.residual * 100, c=d["rows"], cmap="plasma", vmin=1, vmax=max(rows_all) / 0.85, s=9)
    res.axhline(0, color="black", lw=0.8)
    span = max(1.0, float(d.residual.abs().max() * 100) * 1.15)  # at least ±1%: rounding is not a miss
    res.set_ylim(-span, span)
    res.set_xlabel("K/V tokens read by the step (tokens, all rows)")
    res.set_ylabel("measured / model - 1 (%)")
    res.set_title(f"{b}: residual at every measured point ({len(d)} points, all row counts)")
fig.suptitle(f"Decode step cost, {table.device_name} ({S.table_label(table)})")
worst = decode.loc[decode.residual.abs().idxmax()]
mixed = decode[decode.kv_tokens != decode["rows"] * decode.kv_max]  # equal rows are the model's own knots
S.save(fig, "05_decode",
       f"Decode cost grows with the K/V read and the rows; at points with rows of mixed lengths the model is "
       f"within {mixed.residual.abs().median():.1%} of the measured median (median |residual|), "
       f"{worst.residual:+.1%} at worst over all points ({worst.backend}, {int(worst['rows'])} "
       f"row{'s' if worst['rows'] > 1 else ''}, {int(worst.kv_read)} K/V tokens read).")

# %% [markdown]
# ## Held-out accuracy
#
# The calibration also measures shapes off the fitting grid (random widths, lengths and row counts) and
# records the model's prediction beside the measurement: the error a simulation inherits between grid points.

# %%
acc = table.raw.get("accuracy")
if not acc or not acc.get("points"):
    print(f"This cost table has no held-out accuracy section (servecap/calibrate/accuracy.py writes one); "
          f"no accuracy figure is drawn for {S.rel(table_file)}.")
else:
    pts = pd.DataFrame(acc["points"])
    pts["error"] = pts.predicted_s / pts.measured_s - 1
    kinds = list(dict.fromkeys(pts.kind))
    kcolors = dict(zip(kinds, ["tab:green", "tab:blue", "tab:orange", "tab:purple", "tab:brown"]))
    targets = acc.get("targets", {})
    summary = pd.DataFrame(acc.get("summary", {})).T
    if not summary.empty:
        print(summary.to_string(float_format=lambda v: f"{v:.4f}"))

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    for k in kinds:
        p = pts[pts.kind == k]
        ax.plot(p.measured_s * 1e3, p.predicted_s * 1e3, "o", color=kcolors[k], ms=5, label=f"{k} ({len(p)})")
    lo, hi = pts[["measured_s", "predicted_s"]].min().min() * 1e3, pts[["measured_s", "predicted_s"]].max().max() * 1e3
    line = np.geomspace(lo / 1.2, hi * 1.2, 10)
    ax.plot(line, line, color="black", lw=0.8, label="y = x")
    ax.fill_between(line, line * 0.9, line * 1.1, color="grey", alpha=0.15, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Held-out shapes: predicted against measured")
    ax.legend()

    rng = np.random.default_rng(0)
    for i, k in enumerate(kinds):
        e = pts[pts.kind == k].error * 100
        ax2.scatter(e, i + rng.uniform(-0.15, 0.15, len(e)), color=kcolors[k], s=18, alpha=0.8)
        ax2.boxplot(e, positions=[i], orientation="horizontal", widths=0.5, showfliers=False,
                    medianprops={"color": "black"}, boxprops={"color": "0.4"}, whiskerprops={"color": "0.4"})
    for t, ls in ((targets.get("median_abs_err"), ":"), (targets.get("p95_abs_err"), "--")):
        if t:
            for sgn in (-1, 1):
                ax2.axvline(sgn * t * 100, color="grey", ls=ls, lw=1)
    ax2.set_yticks(range(len(kinds)), kinds)
    ax2.set_xlabel("prediction error, predicted / measured - 1 (%)")
    ax2.set_title("Error distribution per kind (dotted: median target, dashed: p95 target)")
    fig.suptitle(f"Cost model accuracy on held-out shapes, {table.device_name}")
    parts = [f"{k} median |error| {np.median(np.abs(pts[pts.kind == k].error)):.1%}" for k in kinds]
    tgt = (f" (targets: median {targets['median_abs_err']:.0%}, p95 {targets['p95_abs_err']:.0%})"
           if {"median_abs_err", "p95_abs_err"} <= set(targets) else "")
    S.save(fig, "05_accuracy", "Off the fitting grid: " + "; ".join(parts) + tgt + ".")

# %% [markdown]
# ## Stationarity: did a step's cost depend on its shape alone?
#
# The calibration runs shapes the engine has never run, once and then again. A first run much slower than its
# repeats means the cost depended on what ran before (a kernel compiled or a buffer allocated on first sight),
# which a table of shapes cannot hold. Each dot is one such shape; the table is refused by default when the
# p95 of first / repeat passes the limit (dashed).

# %%
st = table.stationarity or {}
shapes = pd.DataFrame(st.get("shapes") or [])
if shapes.empty:
    print(f"{S.rel(table_file)} keeps no per-shape stationarity runs "
          f"({st.get('method', 'no stationarity check')}); no stationarity figure is drawn.")
else:
    shapes["group"] = [k if k == "decode" else f"prefill {str(p).partition(':')[0]}"
                       for k, p in zip(shapes.kind, shapes.policy)]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, (g, d) in enumerate(shapes.groupby("group", sort=False)):
        color = S.policy_color(g.split()[-1]) if g != "decode" else "tab:blue"
        x = i + np.random.default_rng(i).uniform(-0.2, 0.2, len(d))
        ax.plot(x, d.first_over_again, "o", color=color, mec="black", mew=0.3, ms=6, label=f"{g} ({len(d)} shapes)")
    ax.axhline(st["limit"], color="tab:red", ls="--", lw=1, label=f"limit on the p95 ({st['limit']:g})")
    ax.axhline(1.0, color="black", lw=0.8)
    groups = list(dict.fromkeys(shapes.group))
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(min(0.9, shapes.first_over_again.min() - 0.02), max(st["limit"], shapes.first_over_again.max()) + 0.08)
    ax.set_ylabel("first run / median of repeats")
    ax.legend(loc="upper right", ncol=3)
    verdict = "passed" if st["passed"] else "FAILED"
    ax.set_title(f"First run against repeats per never-run shape: check {verdict} (cost table {table.table_id})")
    p95 = max(st["prefill"]["p95"], st["decode"]["p95"])
    worst = shapes.loc[shapes.first_over_again.idxmax()]
    S.save(fig, "05_stationarity",
           f"The stationarity check {verdict}: the p95 of first / repeat is {p95:.2f} against a limit of "
           f"{st['limit']:g}; the slowest first run was {worst.first_over_again:.2f}x its repeats ({worst.run}).")
