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
# model that serves every shape between them (calibrate/cost_model.py):
#
# - **prefill** of one admission group: a smooth surface over group width x padded length;
# - **decode** of one step: per row count, a line in the K/V tokens the attention reads
#   (true lengths for `paged`, rows x the widest row for `padded`);
# - **held-out accuracy**: the fitted model against shapes the fit never saw.
#
# Data: the table in `SERVECAP_TABLE` (default `sim/data/h200.json`). Figures: `FIGURES_DIR`
# (default `notebooks/figures`).

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from calibrate.cost_model import CostModel, ExtrapolationWarning

table, table_file = S.load_table()
cost = CostModel(table)
prefill = pd.DataFrame(table["prefill"]["points"])
decode = pd.concat([pd.DataFrame(d["points"]).assign(backend=b) for b, d in table["decode"].items()],
                   ignore_index=True)
print(f"{len(prefill)} prefill points ({prefill.width.nunique()} widths x {prefill.padded_len.nunique()} lengths), "
      + ", ".join(f"{(decode.backend == b).sum()} {b} decode points" for b in table["decode"]))
print("overhead:", {k: v for k, v in table.get("overhead", {}).items()})

# %% [markdown]
# ## Prefill: one admission group, by width and padded length
#
# A group of `width` prompts left-padded to `padded_len` costs about the same as `width x padded_len`
# positions of work once it is past the launch-bound floor, so the right panel divides by that: the
# cost of one padded position. Where the lines flatten, padding is paid in full.

# %%
widths = sorted(prefill.width.unique())
colors = dict(zip(widths, plt.cm.viridis(np.linspace(0, 0.9, len(widths)))))
dense = np.geomspace(prefill.padded_len.min(), prefill.padded_len.max(), 80).round().astype(int)

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
for w in widths:
    pts = prefill[prefill.width == w].sort_values("padded_len")
    fitted = np.array([cost.prefill(int(w), int(n)) for n in dense])
    yerr = [pts.median_s - pts.p10_s, pts.p90_s - pts.median_s]
    ax.errorbar(pts.padded_len, pts.median_s * 1e3, yerr=np.array(yerr) * 1e3, fmt="o", ms=4, capsize=2,
                color=colors[w], label=f"width {w}")
    ax.plot(dense, fitted * 1e3, color=colors[w], lw=1.2)
    per = pts.median_s / (pts.width * pts.padded_len)
    ax2.plot(pts.padded_len, per * 1e6, "o", ms=4, color=colors[w])
    ax2.plot(dense, fitted / (w * dense) * 1e6, color=colors[w], lw=1.2, label=f"width {w}")
for a in (ax, ax2):
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("padded prompt length (tokens)")
ax.set_ylabel("prefill step time (ms)")
ax.set_title("Prefill step: measured median (p10-p90 bars) and fitted surface (lines)")
ax2.set_ylabel("time per padded position (µs)")
ax2.set_title("Cost per padded position: step time / (width x padded length)")
ax.legend(title="group width (rows)", ncol=2)
fig.suptitle(f"Prefill cost, {table['device']['name']}")
big = prefill.sort_values(["width", "padded_len"]).iloc[-1]
S.save(fig, "05_prefill",
       f"The fitted surface passes through every measured median; the widest group ({int(big.width)} x "
       f"{int(big.padded_len)}) costs {big.median_s * 1e3:.0f} ms, and short groups sit on a launch floor of "
       f"{prefill.median_s.min() * 1e3:.1f} ms.")

# %% [markdown]
# ## Decode: one step, by K/V tokens read and row count
#
# Each row count gets its own line. `paged` reads each row at its true length; `padded` reads every row at
# the widest row's length, so the same batch reads (and costs) more. The bottom row shows how far each
# measured median is from its fitted line.

# %%
backends = sorted(table["decode"], key=lambda b: (b != "paged", b))
rows_all = sorted(decode["rows"].unique())
shown = [r for r in rows_all if r in (1, 2, 4, 8, 16, 24, 32)] or rows_all
rcolors = dict(zip(shown, plt.cm.plasma(np.linspace(0, 0.85, len(shown)))))
fig, axes = plt.subplots(2, len(backends), figsize=(6 * len(backends), 7.2), squeeze=False,
                         gridspec_kw={"height_ratios": [3, 1.3]}, sharex="col")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", ExtrapolationWarning)
    decode["fitted_s"] = [float(cost.decode(b, int(r), int(k))) for b, r, k in
                          zip(decode.backend, decode["rows"], decode.kv_read)]
decode["residual"] = decode.median_s / decode.fitted_s - 1
for j, b in enumerate(backends):
    ax, res = axes[0, j], axes[1, j]
    d = decode[decode.backend == b]
    for r in shown:
        pts = d[d["rows"] == r].sort_values("kv_read")
        if pts.empty:
            continue
        kv = np.linspace(pts.kv_read.min(), pts.kv_read.max(), 50) if len(pts) > 1 else pts.kv_read.to_numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExtrapolationWarning)
            ax.plot(kv, np.asarray(cost.decode(b, int(r), kv)) * 1e3, color=rcolors[r], lw=1.2)
        ax.errorbar(pts.kv_read, pts.median_s * 1e3, yerr=[(pts.median_s - pts.p10_s) * 1e3,
                                                           (pts.p90_s - pts.median_s) * 1e3],
                    fmt="o", ms=3.5, capsize=2, color=rcolors[r], label=f"{r} row{'s' if r > 1 else ''}")
    ax.set_xscale("log")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(f"{b}: measured median (p10-p90) and fitted line per row count")
    ax.legend(ncol=2, title="rows shown")
    res.scatter(d.kv_read, d.residual * 100, c=d["rows"], cmap="plasma", vmin=1, vmax=max(rows_all) / 0.85, s=9)
    res.axhline(0, color="black", lw=0.8)
    span = max(1.0, float(d.residual.abs().max() * 100) * 1.15)  # at least ±1%: rounding is not a miss
    res.set_ylim(-span, span)
    res.set_xlabel("K/V tokens read by the step (tokens, all rows)")
    res.set_ylabel("measured / fitted - 1 (%)")
    res.set_title(f"{b}: fit residual at every measured point ({len(d)} points, all row counts)")
fig.suptitle(f"Decode step cost, {table['device']['name']}")
worst = decode.loc[decode.residual.abs().idxmax()]
S.save(fig, "05_decode",
       f"Decode cost is a line in K/V tokens read for each row count; the largest miss of a fitted line on a measured "
       f"median is {worst.residual:+.1%} ({worst.backend}, {int(worst['rows'])} rows, {int(worst.kv_read)} K/V tokens).")

# %% [markdown]
# ## Held-out accuracy
#
# The calibration also measures shapes off the fitting grid (random widths, lengths and row counts) and
# records the model's prediction beside the measurement: the error a simulation inherits between grid points.

# %%
acc = table.get("accuracy")
if not acc or not acc.get("points"):
    print(f"This cost table has no held-out accuracy section (calibrate/accuracy.py writes one); "
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
    fig.suptitle(f"Cost model accuracy on held-out shapes, {table['device']['name']}")
    parts = [f"{k} median |error| {np.median(np.abs(pts[pts.kind == k].error)):.1%}" for k in kinds]
    tgt = (f" (targets: median {targets['median_abs_err']:.0%}, p95 {targets['p95_abs_err']:.0%})"
           if {"median_abs_err", "p95_abs_err"} <= set(targets) else "")
    S.save(fig, "05_accuracy", "Off the fitting grid: " + "; ".join(parts) + tgt + ".")
