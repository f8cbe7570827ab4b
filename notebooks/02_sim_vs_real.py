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
# # 02 · The simulator against the real engine
#
# The validation (sim/validate.py) ran the same seeded traces on the real engine and in the simulator: below,
# near and past capacity, at a small pool, on the other backend, closed controls, and a public trace. This
# notebook puts predicted and measured side by side for every point. Where a point was repeated on the
# engine, the measured value is the median of the repeats and the bars span the lowest to the highest repeat:
# the run-to-run spread any prediction has to live with.
#
# Data: `SERVECAP_VALIDATION` (default `results/validation`: plan.json and real/<point>/run-<k>/) and the
# table in `SERVECAP_TABLE` (default `sim/data/h200.json`). Figures: `FIGURES_DIR`.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import json
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from calibrate.cost_model import CostModel
from sim import SimConfig, simulate
from traces.metrics import summary
from sim.validate import ABS_FLOOR, compare, headline, load_plan, run_dir
from traces.errors import InputError
from traces.workload import poisson_trace

table, table_file = S.load_table()
vdir = S.validation_dir()
plan, points = load_plan(vdir)
if plan.get("table") != table["table_id"]:
    print(f"note: the plan was chosen with cost table {plan.get('table')}; the predictions here use "
          f"{table['table_id']}")
t0 = time.perf_counter()
try:
    results = compare(vdir, table_file)
except InputError as e:
    S.bad_input(e)
if not results:
    S.missing(vdir / "real", S.MAKE_REAL)
print(f"{len(results)} of {len(points)} planned points have real records "
      f"({sum(len(c.real) for c in results)} runs); compared in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## Every point, predicted and measured
#
# One row per point and metric: the simulator's prediction, the median of the real repeats and their range.

# %%
METRICS = {"served_rate": ("served rate", "req/s"), "queue_wait_p50": ("queue wait p50", "s"),
           "queue_wait_p95": ("queue wait p95", "s"), "ttft_p50": ("TTFT p50", "s"), "ttft_p95": ("TTFT p95", "s"),
           "tpot_p50": ("TPOT p50", "s"), "group_size_p50": ("group size p50", "requests"),
           "group_size_p95": ("group size p95", "requests"), "group_size_max": ("group size max", "requests")}
EXTRA = {"wall_time_s": ("closed-run wall time", "s")}


def error(pred: float, meas: float, key: str) -> float:
    """(predicted - measured) / measured, with sim/validate.py's floor under near-zero waits."""
    return (pred - meas) / max(abs(meas), ABS_FLOOR.get(key, 1e-9))


long = []
for c in results:
    for key in list(METRICS) + (list(EXTRA) if c.rate is None else []):
        reps = np.array([r[key] for r in c.real], float)
        if key not in c.sim or not np.isfinite(reps).any():
            continue
        meas = float(np.nanmedian(reps))
        long.append({"point": c.point.id, "role": c.point.role, "backend": c.point.backend,
                     "max_batch": c.point.max_batch, "rate": c.rate, "metric": key, "repeats": len(reps),
                     "sim": float(c.sim[key]), "real": meas, "real_lo": float(np.nanmin(reps)),
                     "real_hi": float(np.nanmax(reps)), "error": error(float(c.sim[key]), meas, key)})
long = pd.DataFrame(long)
wide = long.pivot(index="point", columns="metric", values="error").reindex([c.point.id for c in results])
print(long[long.metric.isin(["served_rate", "queue_wait_p50", "ttft_p50", "tpot_p50"])].pivot(
    index="point", columns="metric", values=["sim", "real"]).reindex([c.point.id for c in results]).to_string(
    float_format=lambda v: f"{v:.4g}"))
try:
    h = headline(results)
    print("\nvalidation targets (sim/validate.py headline):")
    for k, v in h.items():
        print(f"  {k}: {v}")
except Exception as e:  # noqa: BLE001  (a partial set of points lacks the curve or the controls: just say so)
    print(f"headline not available for this set of points ({e})")

# %% [markdown]
# ## The served-rate curve with the real points
#
# The lines are the simulator, swept finely over arrival rate on each arrival configuration the plan measured
# (same trace, backend, rows and pool blocks as the real runs). Filled markers: the engine (median, range of
# the repeats); open markers: the simulator's prediction at the same point.

# %%
cost = CostModel(table)
arrivals = [c for c in results if c.rate is not None and c.point.trace["kind"] == "poisson"]
groups: dict[tuple, list] = {}
for c in arrivals:
    key = (c.point.backend, c.point.max_batch, c.point.pool_gib)
    groups.setdefault(key, []).append(c)
GROUP_COLORS = ["tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:brown"]


def group_label(key) -> str:
    backend, rows, pool = key
    return f"{backend}, {rows} rows, " + (f"{pool:g} GiB pool" if pool else "engine's pool")


def real_pool_blocks(c) -> int:
    """The pool the engine actually ran with (points planned without a pool use the engine's own)."""
    for k in range(1, c.point.repeats + 1):
        path = run_dir(vdir, c.point, k) / "meta.json"
        meta = json.loads(path.read_text()) if path.exists() else {}
        if meta.get("status") == "complete":
            return meta["pool_blocks"]
    raise AssertionError(f"{c.point.id}: compare() found a complete run that is not there")


curves = {}
t0 = time.perf_counter()
for key, cs in groups.items():
    spec, pool_blocks = cs[0].point.trace, real_pool_blocks(cs[0])
    rows = []
    for r in np.geomspace(min(c.rate for c in cs) * 0.7, max(c.rate for c in cs) * 1.1, 18):
        rec = simulate(poisson_trace(float(r), spec["n"], spec["seed"]), cost,
                       SimConfig(key[0], key[1], pool_blocks, S.BLOCK_SIZE)).record
        rows.append(summary(rec, float(r)))
    curves[key] = pd.DataFrame(rows)
print(f"simulated curves: {sum(len(v) for v in curves.values())} runs in {time.perf_counter() - t0:.1f} s")

# %%
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
top = 0
for i, (key, cs) in enumerate(groups.items()):
    col = GROUP_COLORS[i % len(GROUP_COLORS)]
    cv = curves[key]
    top = max(top, cv.rate.max())
    ax.plot(cv.rate, cv.served_rate, color=col, **S.SIM, label=f"{group_label(key)}: simulator")
    for c in cs:
        reps = [r["served_rate"] for r in c.real]
        med = float(np.median(reps))
        ax.errorbar(c.rate, med, yerr=[[med - min(reps)], [max(reps) - med]], color=col, **S.REAL)
        ax.plot(c.rate, c.sim["served_rate"], "s", mfc="none", mec=col, ms=9)
        for key_w, ls in (("queue_wait_p50", "-"), ("queue_wait_p95", "--")):
            reps = [r[key_w] for r in c.real]
            med = float(np.median(reps))
            ax2.errorbar(c.rate, med, yerr=[[med - min(reps)], [max(reps) - med]], color=col,
                         **{**S.REAL, "fmt": "o" if ls == "-" else "^"})
            ax2.plot(c.rate, c.sim[key_w], "s" if ls == "-" else "D", mfc="none", mec=col, ms=8)
    ax2.plot(cv.rate, cv.queue_wait_p50, color=col, **S.SIM, label=f"{group_label(key)}: p50")
    ax2.plot(cv.rate, cv.queue_wait_p95, color=col, ls="--", lw=1.2, label=f"{group_label(key)}: p95")
ax.plot([0, top], [0, top], ":", color="grey", lw=1, label="served = offered")
ax.plot([], [], "o", color="grey", mec="black", label="real engine (median, range of repeats)")
ax.plot([], [], "s", mfc="none", mec="grey", label="simulator at the real point")
ax.set_xlabel("arrival rate (req/s)")
ax.set_ylabel("served rate (req/s)")
ax.set_title("Served rate: simulator curve and real points")
ax.legend(loc="upper left")
ax2.set_yscale("symlog", linthresh=1e-2)
ax2.set_ylim(bottom=0)
ax2.set_xlabel("arrival rate (req/s)")
ax2.set_ylabel("queue wait (s): p50 solid / circles, p95 dashed / triangles")
ax2.set_title("Queue wait: simulator curve and real points")
ax2.legend(loc="upper left", fontsize=7)
fig.suptitle(f"Simulator against the real engine ({plan.get('n', '?')} requests per arrival point; cost table "
             f"{table['table_id']})")
serr = long[long.metric == "served_rate"]
worst = serr.loc[serr.error.abs().idxmax()]
S.save(fig, "02_served_rate_curve",
       f"Served rate: the largest miss at any point is {worst.error:+.1%} ({worst.point}); the engine's own "
       f"repeat-to-repeat range is up to {((serr.real_hi - serr.real_lo) / serr.real).max():.1%}.")

# %% [markdown]
# ## Predicted against measured, metric by metric
#
# Every point in every panel: measured (median of the repeats, bars for their range) on x, predicted on y.
# On the line the simulator is exact; the shaded band is ±10%. Waits near zero sit on the linear part of
# the axis (below 1 ms).

# %%
keys = [k for k in METRICS if k in set(long.metric)]
ncol = 3
fig, axes = plt.subplots(-(-len(keys) // ncol), ncol, figsize=(13, 3.9 * -(-len(keys) // ncol)), squeeze=False)
for ax, key in zip(axes.flat, keys):
    d = long[long.metric == key]
    for role, g in d.groupby("role", sort=False):
        ax.errorbar(g.real, g.sim, xerr=[g.real - g.real_lo, g.real_hi - g.real], fmt="o", ms=5, capsize=2,
                    color=S.ROLE_COLORS.get(role, "black"), mec="black", mew=0.4, label=role)
    lo, hi = min(d.real_lo.min(), d.sim.min()), max(d.real_hi.max(), d.sim.max())
    name, unit = METRICS[key]
    if key.startswith("queue_wait"):  # zero for a closed run's first group: linear below 1 ms
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_yscale("symlog", linthresh=1e-3)
        line = np.concatenate([[0], np.geomspace(1e-4, max(hi, 1e-3) * 1.5, 60)])
    elif key.startswith(("ttft", "group_size")):  # spans decades
        base = 2 if key.startswith("group_size") else 10
        ax.set_xscale("log", base=base)
        ax.set_yscale("log", base=base)
        line = np.geomspace(max(lo, 1e-6) / 1.3, hi * 1.3, 60)
        S.plain_ticks(ax)
    else:
        line = np.linspace(lo * 0.9, hi * 1.1, 60)
    ax.plot(line, line, color="black", lw=0.8)
    ax.fill_between(line, line * 0.9, line * 1.1, color="grey", alpha=0.15, lw=0)
    ax.set_xlabel(f"measured {name} ({unit})")
    ax.set_ylabel(f"predicted {name} ({unit})")
    e = d.error.abs()
    ax.set_title(f"{name}: median |error| {e.median():.1%}, worst {e.max():.0%}")
for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
seen = {}
for ax in list(axes.flat)[:len(keys)]:
    for handle, label in zip(*ax.get_legend_handles_labels()):
        seen.setdefault(label, handle)
axes.flat[0].legend(list(seen.values()), list(seen), loc="upper left", title="point role")
fig.suptitle("Predicted against measured at every validation point (bars: range of the real repeats)")
within = (long[long.metric.isin(keys)].error.abs() <= 0.10).mean()
S.save(fig, "02_predicted_vs_measured",
       f"{within:.0%} of all point-metric pairs are within ±10% (the band); points off the line are where the "
       f"simulator misses, and the bars show how much the engine itself varies.")

# %% [markdown]
# ## The errors, all at once
#
# (predicted - measured) / measured for every point and metric; queue wait p50 errors use sim/validate.py's
# 20 ms floor under the denominator, so a few milliseconds of a near-zero wait do not read as 100%.

# %%
cols = [k for k in list(METRICS) + list(EXTRA) if k in wide.columns]
grid = wide[cols]
fig, ax = plt.subplots(figsize=(1.05 * len(cols) + 4, 0.36 * len(grid) + 2.2))
im = ax.imshow(grid.to_numpy(float) * 100, cmap="RdBu_r", vmin=-25, vmax=25, aspect="auto")
for (i, j), v in np.ndenumerate(grid.to_numpy(float)):
    if np.isfinite(v):
        ax.text(j, i, f"{v * 100:+.0f}", ha="center", va="center", fontsize=7.5,
                color="white" if abs(v) > 0.17 else "black")
reps = {c.point.id: len(c.real) for c in results}
ax.set_yticks(range(len(grid)), [f"{p} (x{reps[p]})" for p in grid.index])
ax.set_xticks(range(len(cols)), [{**METRICS, **EXTRA}[k][0] for k in cols], rotation=35, ha="right")
ax.grid(False)
fig.colorbar(im, ax=ax, label="prediction error (%), clipped at ±25", shrink=0.8)
ax.set_title("Prediction error per point (rows, with real repeats) and metric (columns), %")
flat = long.loc[long.error.abs().idxmax()]
S.save(fig, "02_errors",
       f"Blue: the simulator predicts low, red: high; the largest miss is {flat.error:+.0%} "
       f"({({**METRICS, **EXTRA})[flat.metric][0]} at {flat.point}).")
