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
# The validation (validate/) wrote down the simulator's prediction for every point before the engine ran it,
# from the cost table its plan names, then ran the points on the engine. Its points come in groups: the seeded
# Poisson curve (below, near and past capacity) and a small pool; public traces, each replayed on a freshly
# started engine; closed controls; the prefill policies (with the blind predictions made before the engine had
# them); the sag candidates; and a fleet of two replicas behind a router.
#
# Everything here comes from `validate.report.compare` (the protocol checks, the predictions, the measured
# repeats and the trace's seed spread) and `validate.report.targets`: this notebook adds no metric of its own.
# Where a point was repeated on the engine, the measured value is the median of the repeats and the bars span
# the lowest to the highest: the engine's own run-to-run spread. Where the trace is seeded, the open markers
# carry ±2 sd of the simulator over trace seeds: the spread of the workload itself.
#
# Data: `SERVECAP_VALIDATION` (default `results/validation`) and the cost table its plan names. Figures:
# `FIGURES_DIR`.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import math
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from servecap.costs.model import CostModel
from servecap.sim import SimConfig, simulate
from servecap.sim.fleet import simulate_fleet
from servecap.traces.errors import InputError
from servecap.traces.metrics import summary
from servecap.validate.points import build_trace
from servecap.validate.report import KEYS, beyond_spread, compare, targets

vdir, plan, points, table, table_file = S.validation()
t0 = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        plan, results = compare(vdir, table_file, allow_nonstationary=True)
    except InputError as e:
        S.bad_input(e)
for message in dict.fromkeys(str(w.message) for w in caught if "no complete real records" in str(w.message)):
    print("note:", message)
if not results:
    S.missing(vdir / "real", S.MAKE_REAL)
TABLE = S.table_label(table)
print(f"{len(results)} of {len(points)} planned points graded ({sum(len(c.real) for c in results)} real runs) in "
      f"{time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ## The targets
#
# `validate.report.targets`: each target of the validation with its limit, how many points meet it and the worst
# error. Errors are (predicted - measured) / measured, with a 20 ms floor under near-zero queue waits.

# %%
tg = pd.DataFrame(targets(results))
print(tg[["target", "met", "of", "worst", "worst_point", "limit"]].to_string(
    index=False, float_format=lambda v: f"{v:.3f}", max_colwidth=60))

fig, ax = plt.subplots(figsize=(14, 0.36 * len(tg) + 2.0))
for i, t in tg.iterrows():
    ok = t.met == t.of and t.of > 0
    color = "tab:green" if ok else ("0.7" if t.of == 0 else "tab:red")
    ax.plot(0, i, "s", color=color, ms=7, clip_on=False)
    worst = t.worst if isinstance(t.worst, float) and math.isfinite(t.worst) else None
    if worst is not None:
        ax.barh(i, worst * 100, color=color, height=0.6)
    if t.limit is not None and isinstance(t.limit, float) and math.isfinite(t.limit):
        ax.plot([t.limit * 100] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
    label = f" met at {t.met} of {t.of}" + ("" if worst is None else f"  (worst {worst:.1%}, {t.worst_point})")
    ax.text(max(worst or 0, t.limit or 0) * 100, i, label, va="center", fontsize=7.5)
ax.set_yticks(range(len(tg)), tg.target)
ax.invert_yaxis()
ax.set_xscale("symlog", linthresh=10)
ax.set_xlim(0, max(100, float(np.nanmax(pd.to_numeric(tg.worst, errors="coerce").fillna(0))) * 100) * 60)
ax.set_xlabel("worst |prediction error| over the target's points (%); black tick: the target's limit")
ax.set_title(f"Validation targets: worst |error| against the limit (green: met at every point)\n{TABLE}")
S.plain_ticks(ax, "x")
full = int(((tg.met == tg.of) & (tg.of > 0)).sum())
S.save(fig, "02_targets",
       f"{full} of {int((tg.of > 0).sum())} targets are met at every point they cover; missed at some point: "
       + "; ".join(f"{t.target} ({t.met} of {t.of})" for t in tg[(tg.met < tg.of)].itertuples()) + ".")

# %% [markdown]
# ## Every point, predicted and measured
#
# One row per point and metric: the prediction, the median of the real repeats and their range, the error, the
# blind prediction's error (policies) and the seed spread (seeded traces).
#
# The report's seed spread of a fleet point is computed for one engine at the fleet's rate
# (`validate.comparison._spread` simulates a single replica), so it is left out for fleet points.

# %%
METRICS = {"served_rate": ("served rate", "req/s"), "queue_wait_p50": ("queue wait p50", "s"),
           "queue_wait_p95": ("queue wait p95", "s"), "ttft_p50": ("TTFT p50", "s"), "ttft_p95": ("TTFT p95", "s"),
           "tpot_p50": ("TPOT p50", "s"), "group_size_p95": ("group size p95", "requests"),
           "padding_waste_p95": ("padding waste p95", "positions / token"),
           "wall_time_s": ("closed-run wall time", "s"), "gap_max": ("largest incumbent gap", "s")}
assert set(KEYS) <= set(METRICS), f"validate.report.KEYS has new metrics: {set(KEYS) - set(METRICS)}"


def spread(c, key: str) -> float:
    if c.spread is None or c.point.serving.replicas > 1 or key not in c.spread:
        return math.nan
    return c.spread[key]


long = []
for c in results:
    m = c.measured
    for key in METRICS:
        if key not in m or c.sim.get(key) is None or (key == "wall_time_s" and c.rate is not None):
            continue
        reps = np.array([r[key] for r in c.real], float)
        long.append({"point": c.point.id, "role": c.point.role, "rate": c.rate, "metric": key,
                     "repeats": len(c.real), "sim": float(c.sim[key]), "real": float(m[key]),
                     "real_lo": float(np.nanmin(reps)), "real_hi": float(np.nanmax(reps)), "error": c.err(key),
                     "blind_error": c.err(key, c.blind) if c.blind and c.blind.get(key) is not None else math.nan,
                     "seed_sd": spread(c, key)})
long = pd.DataFrame(long)
order = [c.point.id for c in results]
print(long[long.metric.isin(["served_rate", "queue_wait_p50", "ttft_p50"])].pivot(
    index="point", columns="metric", values="error").reindex(order).to_string(float_format=lambda v: f"{v:+.1%}"))

# %% [markdown]
# ## Served rate and queue wait against arrival rate, group by group
#
# Lines: the simulator on the plan's table, swept over arrival rate with each group's trace and configuration
# (a fleet with its router). Filled markers: the engine (median, range of repeats). Open squares: the
# prediction written in the plan for that point, with ±2 sd over trace seeds where the trace is seeded. The
# closed controls have no arrival rate: their panel shows each one's prediction and measurement side by side.

# %%
cost = CostModel(table)
GROUPS = {
    "seeded trace and a small pool": lambda c: c.point.role in ("below", "near", "past", "small-pool"),
    "prefill policies, seeded trace": lambda c: c.point.role == "policy" and c.point.trace["kind"] == "poisson",
    "public traces (fresh engine); Azure window per policy":
        lambda c: c.rate is not None and c.point.trace["kind"] == "file",
    "sag candidates": lambda c: c.point.role == "sag",
    "fleet of two replicas": lambda c: c.point.role == "fleet",
    "closed controls": lambda c: c.rate is None,
}


def series(c) -> tuple:
    """The line a point sits on: same trace family and configuration, any rate."""
    p = c.point
    if p.trace["kind"] == "file":
        stem = p.trace["path"].rsplit("/", 1)[-1].removesuffix(".csv")
        return (stem.rsplit("-", 1)[0] if stem.endswith(("-below", "-near", "-past")) else stem, str(p.serving.prefill))
    return (p.trace["kind"], p.trace.get("prompts"), p.trace.get("budgets"), p.serving.pool.gib, p.serving.max_batch, str(p.serving.prefill),
            p.serving.replicas, p.serving.router)


def series_label(c) -> str:
    p = c.point
    if p.role == "sag":
        return p.id.rsplit("-rate-", 1)[0].removeprefix("sag-")
    if p.role == "fleet":
        mix = f", {p.trace['prompts']}/{p.trace['budgets']}" if p.trace["kind"] == "synthetic" else ""
        return f"{p.serving.router}{mix}"
    if p.role == "policy":
        return str(p.serving.prefill)
    if p.trace["kind"] == "file":
        return series(c)[0]
    return f"{p.serving.max_batch} rows, " + (f"{p.serving.pool.gib:g} GiB pool" if p.serving.pool.gib else "engine's pool")


def simulate_point(p, rate: float) -> dict:
    trace = build_trace({**p.trace, "rate": rate}, vdir)
    cfg = SimConfig(p.serving)
    rec = simulate_fleet(trace, cost, cfg).record if p.serving.replicas > 1 else \
        simulate(trace, cost, cfg).record
    return summary(rec, rate)


t0 = time.perf_counter()
curves = {}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # extrapolation and derived-policy notes: compare() already said them
    for name, keep in GROUPS.items():
        for c in (c for c in results if keep(c) and c.rate is not None and c.point.trace["kind"] != "file"):
            key = series(c)
            if key in curves:
                continue
            rates = [x.rate for x in results if x.rate is not None and series(x) == key]
            grid = np.geomspace(min(rates) * 0.6, max(rates) * 1.1, 9 if c.point.serving.replicas > 1 else 12)
            curves[key] = pd.DataFrame([simulate_point(c.point, float(r)) for r in grid])
print(f"{len(curves)} simulated curves, {sum(len(v) for v in curves.values())} runs in "
      f"{time.perf_counter() - t0:.0f} s")

# %%
COLOR_CYCLE = ["tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:brown", "tab:cyan", "tab:olive", "tab:red"]


def series_color(c, i: int) -> str:
    p = c.point
    if p.role == "policy":
        return S.policy_color(str(p.serving.prefill))
    if p.role == "fleet":
        return S.ROUTER_COLORS.get(p.serving.router, COLOR_CYCLE[i % len(COLOR_CYCLE)])
    return COLOR_CYCLE[i % len(COLOR_CYCLE)]


def draw(key: str, closed_key: str, name: str, log: bool):
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
    for ax, (title, keep) in zip(axes.flat, GROUPS.items()):
        group = [c for c in results if keep(c)]
        ax.set_title(f"{title} ({len(group)} points)")
        if not group:
            ax.text(0.5, 0.5, "no graded points in this group", ha="center", transform=ax.transAxes, color="0.4")
            continue
        if title == "closed controls":
            for i, c in enumerate(group):
                reps = [r[closed_key] for r in c.real]
                med = c.measured[closed_key]
                ax.errorbar(i, med, yerr=[[med - min(reps)], [max(reps) - med]], color=S.policy_color(str(c.point.serving.prefill)),
                            **S.REAL)
                ax.plot(i, c.sim[closed_key], color=S.policy_color(str(c.point.serving.prefill)), **S.SIM_POINT)
            ax.set_xticks(range(len(group)), [c.point.id for c in group], rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(f"{METRICS[closed_key][0]} ({METRICS[closed_key][1]})")
            ax.set_ylim(bottom=0)
            continue
        keys = list(dict.fromkeys(series(c) for c in group))
        for i, sk in enumerate(keys):
            members = sorted((c for c in group if series(c) == sk), key=lambda c: c.rate)
            col = series_color(members[0], i)
            label = series_label(members[0])
            if sk in curves:
                cv = curves[sk]
                ax.plot(cv.rate, cv[key], color=col, **S.SIM, label=label)
            for j, c in enumerate(members):
                reps = [r[key] for r in c.real]
                med = c.measured[key]
                ax.errorbar(c.rate, med, yerr=[[med - min(reps)], [max(reps) - med]], color=col, **S.REAL,
                            label=None if sk in curves or j else label)
                sd = spread(c, key)
                ax.errorbar(c.rate, c.sim[key], yerr=2 * sd if math.isfinite(sd) else None, color=col, capsize=2,
                            elinewidth=0.8, **S.SIM_POINT)
        ax.errorbar([], [], yerr=[], color="grey", **S.REAL, label="engine (median, range of repeats)")
        ax.errorbar([], [], yerr=[], color="grey", **S.SIM_POINT, label="plan's prediction (±2 seed sd)")
        ax.plot([], [], color="grey", **S.SIM, label="simulator, same configuration")
        if key == "served_rate":
            top = max(c.rate for c in group) * 1.15
            ax.plot([0, top], [0, top], ":", color="grey", lw=1, label="served = offered")
            ax.set_ylim(0, max(max(c.measured[key] for c in group), max(c.sim[key] for c in group)) * 1.25)
        if log:
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.set_ylim(bottom=0)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"{METRICS[key][0]} ({METRICS[key][1]})")
        ax.legend(loc="upper left", fontsize=6.5)
    return fig, axes


fig, _ = draw("served_rate", "wall_time_s", "served", log=False)
fig.suptitle(f"Served rate against arrival rate: engine (filled), plan's predictions (open), simulator (lines); "
             f"{TABLE}",
             fontsize=10)
serr = long[long.metric == "served_rate"].set_index("point")
worst = serr.error.abs().idxmax()
rep_range = ((serr.real_hi - serr.real_lo) / serr.real)[serr.repeats > 1]
beyond = [c.point.id for c in results if c.point.serving.replicas == 1 and beyond_spread(c, "served_rate")]
S.save(fig, "02_served_rate_curve",
       f"Served rate: median |error| {serr.error.abs().median():.1%} over {len(serr)} points, worst "
       f"{serr.error[worst]:+.1%} ({worst}); the engine's repeat range is up to "
       f"{rep_range.max() if len(rep_range) else float('nan'):.1%} where a point was repeated; "
       f"{len(beyond)} single-engine seeded point(s) miss by more than 2 seed sd"
       + (f" ({', '.join(beyond)})." if beyond else "."))

# %%
fig, _ = draw("queue_wait_p50", "ttft_p50", "queue", log=True)
fig.suptitle(f"Queue wait p50 against arrival rate (closed controls: TTFT p50); engine filled, predictions open, "
             f"simulator lines; {TABLE}", fontsize=10)
qerr = long[(long.metric == "queue_wait_p50")].set_index("point")
qworst = qerr.error.abs().idxmax()
S.save(fig, "02_queue_wait_curve",
       f"Queue wait p50 (errors with a 20 ms floor): median |error| {qerr.error.abs().median():.1%}, worst "
       f"{qerr.error[qworst]:+.0%} at {qworst} (predicted {qerr.sim[qworst]:.3g} s, measured "
       f"{qerr.real[qworst]:.3g} s).")

# %% [markdown]
# ## Predicted against measured, metric by metric
#
# Every point in every panel: measured (median of the repeats, bars for their range) on x, predicted on y.
# On the line the simulator is exact; the shaded band is ±10%. Waits near zero sit on the linear part of the
# axis (below 1 ms).

# %%
keys = [k for k in METRICS if k in set(long.metric)]
ncol = 4
nrow = -(-len(keys) // ncol)
fig, axes = plt.subplots(nrow, ncol, figsize=(16, 3.8 * nrow), squeeze=False)
for ax, key in zip(axes.flat, keys):
    d = long[long.metric == key]
    for role, g in d.groupby("role", sort=False):
        ax.errorbar(g.real, g.sim, xerr=[g.real - g.real_lo, g.real_hi - g.real], fmt="o", ms=5, capsize=2,
                    color=S.ROLE_COLORS.get(role, "black"), mec="black", mew=0.4, label=role)
    lo, hi = min(d.real_lo.min(), d.sim.min()), max(d.real_hi.max(), d.sim.max())
    name, unit = METRICS[key]
    if key.startswith("queue_wait") or key == "padding_waste_p95":  # zeros: linear below a small value
        th = 1e-3 if key.startswith("queue") else 1e-2
        ax.set_xscale("symlog", linthresh=th)
        ax.set_yscale("symlog", linthresh=th)
        line = np.concatenate([[0], np.geomspace(th / 10, max(hi, th) * 1.5, 60)])
    elif lo > 0 and hi / lo > 20:  # spans decades
        ax.set_xscale("log")
        ax.set_yscale("log")
        line = np.geomspace(lo / 1.3, hi * 1.3, 60)
        S.plain_ticks(ax)
    else:
        line = np.linspace(lo * 0.9, hi * 1.1, 60)
    ax.plot(line, line, color="black", lw=0.8)
    ax.fill_between(line, line * 0.9, line * 1.1, color="grey", alpha=0.15, lw=0)
    ax.set_xlabel(f"measured {name} ({unit})")
    ax.set_ylabel(f"predicted ({unit})")
    e = d.error.abs()
    # Two lines: on one, the longer names ran past the panel into the next one's title and out of the figure
    ax.set_title(f"{name}\nmedian |error| {e.median():.1%}, worst " +
                 (f"{e.max():.0%}" if e.max() < 10 else "over 1000%"), fontsize=10)
for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
S.legend_once(fig, list(axes.flat)[:len(keys)], title="point group", ncol=10)
fig.suptitle(f"Predicted against measured at every graded point (bars: range of the real repeats); {TABLE}",
             fontsize=10)
within = (long.error.abs() <= 0.10).mean()
S.save(fig, "02_predicted_vs_measured",
       f"{within:.0%} of all {len(long)} point-metric pairs are within ±10% (the band); points off the line are where "
       f"the simulator misses, and the bars show how much the engine itself varies.")

# %% [markdown]
# ## The errors, all at once
#
# (predicted - measured) / measured for every point and metric, and for the policies also the blind prediction
# (made before the engine had them, from the cost table `python -m validate predict` used; the title names it).

# %%
wide = long.pivot(index="point", columns="metric", values="error").reindex(order)
blind = long.dropna(subset=["blind_error"]).pivot(index="point", columns="metric", values="blind_error")
blind = blind[[k for k in ("served_rate", "ttft_p50", "wall_time_s", "gap_max") if k in blind]].add_suffix(" (blind)")
grid = pd.concat([wide[[k for k in METRICS if k in wide]], blind.reindex(order)], axis=1)
labels = [METRICS[k][0] if k in METRICS else f"{METRICS[k.split(' ')[0]][0]} (blind)" for k in grid.columns]
fig, ax = plt.subplots(figsize=(0.85 * len(grid.columns) + 5, 0.27 * len(grid) + 2.4))
vals = grid.to_numpy(float)
im = ax.imshow(np.clip(vals, -0.5, 0.5) * 100, cmap="RdBu_r", vmin=-25, vmax=25, aspect="auto")
for (i, j), v in np.ndenumerate(vals):
    if np.isfinite(v):
        ax.text(j, i, f"{v * 100:+.0f}" if abs(v) < 10 else (">+999" if v > 0 else "<-999"), ha="center",
                va="center", fontsize=6.5,
                color="white" if abs(v) > 0.17 else "black")
reps = {c.point.id: len(c.real) for c in results}
ax.set_yticks(range(len(grid)), [f"{p} (x{reps[p]})" for p in grid.index], fontsize=7)
ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right")
ax.grid(False)
fig.colorbar(im, ax=ax, label="prediction error (%), colour clipped at ±25", shrink=0.6)
BLIND = f"; blind: cost table {plan['blind']['table']['id']}" if plan.get("blind") else ""
ax.set_title(f"Prediction error per point (rows, with real repeats) and metric (columns), %; {TABLE}{BLIND}",
             fontsize=9)
TARGETED = ("served_rate", "queue_wait_p50", "ttft_p50", "wall_time_s", "gap_max")  # the metrics with targets
graded = long[long.metric.isin(TARGETED)]
flat = graded.loc[graded.error.abs().idxmax()]
S.save(fig, "02_errors",
       f"Blue: the simulator predicts low, red: high; among the metrics with targets the largest miss is "
       f"{flat.error:+.0%} ({METRICS[flat.metric][0]} at {flat.point}). A measured zero (no padding at a point) makes "
       f"any predicted padding an unbounded relative error.")

# %% [markdown]
# ## Misses against the noise they have to live with
#
# For the served rate at every arrival point: the prediction's |error| (bar), the engine's own repeat range
# (where a point was repeated) and twice the seed spread of the trace (where it is seeded), both relative to the
# measured value. A miss inside the seed spread is a miss the workload's own sampling could make.

# %%
arr = long[(long.metric == "served_rate") & long.rate.notna()].reset_index(drop=True)
fig, ax = plt.subplots(figsize=(12, 0.3 * len(arr) + 1.8))
y = np.arange(len(arr))
ax.barh(y, arr.error.abs() * 100, color=[S.ROLE_COLORS.get(r, "grey") for r in arr.role], height=0.6)
ax.barh([], [], color="0.5", label="|prediction error| (colour: point group)")
ax.plot(2 * arr.seed_sd / arr.real * 100, y, "|", color="black", ms=12, mew=2, label="2 seed sd (simulator)")
rep = arr.repeats > 1
ax.plot(((arr.real_hi - arr.real_lo) / arr.real * 100)[rep], y[rep], "o", color="tab:red", mec="black",
        label="engine's repeat range")
ax.set_yticks(y, arr.point, fontsize=7)
ax.invert_yaxis()
ax.set_xlabel("relative to the measured served rate (%)")
ax.set_title(f"Served-rate error against the trace's seed spread and the engine's repeat spread\n{TABLE}", fontsize=9)
ax.legend(loc="lower right")
has_sd = arr.seed_sd.notna()
inside = int((arr.error.abs() * arr.real <= 2 * arr.seed_sd)[has_sd].sum())
S.save(fig, "02_spread",
       f"{inside} of {int(has_sd.sum())} seeded single-engine points miss by less than 2 seed sd; the bars colour the "
       f"point groups as in the scatter.")
