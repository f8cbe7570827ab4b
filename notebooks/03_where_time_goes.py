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
# # 03 · Where the time goes
#
# Two costs that the headline numbers hide, both made by the admission prefill:
#
# 1. **Padding, and the sag it can cause past capacity.** Under padded prefill the requests admitted in one
#    step are prefilled together, each prompt padded to the group's widest. A deeper queue makes bigger groups,
#    bigger groups pad more, and padded prefill takes engine time from decode: past capacity the served rate can
#    fall as the load rises. The validation ran the seeded curve and the sag candidates of a simulator search on
#    the engine.
# 2. **The admission disturbance.** While a group prefills, every running request waits: its next token comes
#    late by the whole prefill. Measured on the closed run of 64 mixed requests through 8 rows, with every
#    token's time recorded.
#
# Every figure reads the real validation records with the shared metrics (servecap/traces/metrics.py) and the wall-time
# split (servecap/traces/explain.py), beside the simulator on the same traces and the cost table the validation plan
# names.
#
# Data: `SERVECAP_VALIDATION` (default `results/validation`) and the cost table its plan names; the sag search
# in `SERVECAP_SAG` (default `results/sag`), optional. Figures: `FIGURES_DIR`. Design notes: docs/DESIGN.md.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from servecap.costs.model import CostModel
from servecap.costs.shapes import PrefillShape
from servecap.sim import SimConfig, simulate
from servecap.traces.explain import PARTS, explain
from servecap.traces.explain_plot import COLORS as PART_COLORS
from servecap.traces.explain_report import PART_LABELS
from servecap.traces.metrics import (SPIKE_FACTOR, admission_groups, groups_at_admission, groups_by_depth, prefill_spikes,
                            summary, token_gaps)
from servecap.validate.points import build_trace, complete_runs, run_dir

vdir, plan, points, table, table_file = S.validation()
search = S.sag_search()
cost = CostModel(table)
TABLE = S.table_label(table)
CURVE = ("below", "near", "past")
DISTURBANCE = "closed-mixed-64-through-8"


def simulated(p, detail: str = "steps"):
    """The simulator's record of point p's own trace and configuration, on the plan's table."""
    cfg = SimConfig(p.serving, detail=detail)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan's predictions said them already
        return simulate(build_trace(p.trace, vdir), cost, cfg).record


def sag_name(p) -> str:
    return p.id.rsplit("-rate-", 1)[0].removeprefix("sag-")


# %% [markdown]
# ## Every arrival run: real and simulated
#
# The seeded curve (the default workload at 32 rows, below, near and past capacity) and each sag candidate, one
# series each, in order of arrival rate. For every point: the first complete real repeat, scored by
# `traces.metrics.summary` and split by `traces.explain.explain`, and the simulator's record of the same trace.

# %%
planned: dict[str, list] = {}
for p in sorted(points, key=lambda p: p.trace.get("rate") or 0):
    if p.role in CURVE:
        planned.setdefault(f"seeded trace, {p.serving.max_batch} rows", []).append(p)
    elif p.role == "sag":
        planned.setdefault(sag_name(p), []).append(p)
t0 = time.perf_counter()
runs = []
for name, pts in planned.items():
    for p in pts:
        real = complete_runs(vdir, p)
        if not real:
            continue
        rate, sim = p.trace["rate"], simulated(p)
        runs.append({"series": name, "point": p.id, "role": p.role, "rate": rate, "real": real[0], "sim": sim,
                     "real_summary": summary(real[0], rate), "sim_summary": summary(sim, rate),
                     "real_split": explain(real[0]), "sim_split": explain(sim)})
if not runs:
    S.missing(vdir / "real", "the plan's arrival-rate points have no complete real records; " + S.MAKE_REAL)
runs = pd.DataFrame(runs)
series = {name: g for name, g in runs.groupby("series", sort=False)}
print(f"{len(runs)} real arrival runs in {len(series)} series, each simulated again, in "
      f"{time.perf_counter() - t0:.1f} s")
print(pd.DataFrame([{"point": r.point, "rate": r.rate, **{f"{k} real/sim": f"{r.real_summary[k]:.3g} / "
                                                          f"{r.sim_summary[k]:.3g}"
                                                          for k in ("served_rate", "group_size_p95",
                                                                    "padding_waste_p95")}}
                    for r in runs.itertuples()]).to_string(index=False))

# %% [markdown]
# ## Where the wall time goes, rate by rate
#
# Each bar is one run's wall time (first arrival to last finish) split by what the engine was doing
# (servecap/traces/explain.py): decode, prefill of real prompt tokens, prefill of padding, the estimated retirement
# overhead, untimed gaps between steps, and idle time. Real runs plain, the simulator hatched beside them.

# %%
fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series) + 1, 5.2), squeeze=False, sharey=True)
for ax, (name, g) in zip(axes[0], series.items()):
    x = np.arange(len(g))
    for offset, side, hatch in ((-0.21, "real_split", ""), (0.21, "sim_split", "//")):
        bottom = np.zeros(len(g))
        for part in PARTS:
            share = np.array([e.split[part] / e.wall for e in g[side]])
            ax.bar(x + offset, share, 0.4, bottom=bottom, color=PART_COLORS[part], hatch=hatch, edgecolor="white",
                   lw=0.3, label=PART_LABELS[part] if not hatch else None)
            bottom += share
    ax.set_xticks(x, [f"{r:g}" for r in g.rate])
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{name} ({len(g)} runs)")
axes[0, 0].set_ylabel("share of the wall time (real plain, simulated hatched)")
S.legend_once(fig, axes[0], ncol=6)
fig.suptitle(f"Wall time split by what the engine did (traces.explain): real runs and the simulator on the same "
             f"traces; {TABLE}", fontsize=10)
MAIN = ("decode", "prefill", "padding")  # the parts that hold nearly all the time
share = {side: np.array([[e.split[p] / e.wall for p in MAIN] for e in runs[side]]) for side in ("real_split",
                                                                                                 "sim_split")}
diff = np.abs(share["sim_split"] - share["real_split"])
worst_run, worst_part = np.unravel_index(diff.argmax(), diff.shape)
pad = [f"{name}: {g.real_split.iloc[0].split['padding'] / g.real_split.iloc[0].wall:.0%} at {g.rate.iloc[0]:g} req/s "
       f"to {g.real_split.iloc[-1].split['padding'] / g.real_split.iloc[-1].wall:.0%} at {g.rate.iloc[-1]:g}"
       for name, g in series.items()]
S.save(fig, "03_time_split",
       "Prefill padding's share of the real wall time: " + "; ".join(pad) + f". In decode, prefill and padding the "
       f"simulator's shares differ from the real ones by a median {np.median(diff) * 100:.1f} percentage points, "
       f"at most {diff.max() * 100:.0f} ({PART_LABELS[MAIN[worst_part]]} at {runs.point.iloc[worst_run]}).")

# %% [markdown]
# ## The sag
#
# Per sag candidate, against arrival rate: the served rate, and the mechanism behind it, admission group size
# and padding waste (padded positions per real prompt token), both p95 over the run's groups. Filled: the
# engine; open: the prediction the validation plan wrote before the run (the same trace, seed 0). Shaded, where
# the sag search is there: its mean served rate over many trace seeds, ±1 sd, on the table it searched. The sag
# is the fall from the peak served rate to the served rate at the highest rate run, over the peak (the search's
# definition, servecap/validate/sag.py).

# %%
def sag(values) -> float:
    values = list(values)
    return (max(values) - values[-1]) / max(values)


candidates = {name: g for name, g in series.items() if (g.role == "sag").all()}
found = {r["name"]: r for r in (search or {}).get("refined", [])}
fig, axes = plt.subplots(1, 3, figsize=(16, 5))
colors = dict(zip(candidates, ["tab:red", "tab:blue", "tab:green", "tab:purple"]))
lines = []
for name, g in candidates.items():
    c = colors[name]
    pred = [plan["predictions"][p] for p in g.point]
    for ax, key in zip(axes, ("served_rate", "group_size_p95", "padding_waste_p95")):
        ax.plot(g.rate, [s[key] for s in g.real_summary], "o-", color=c, mec="black", mew=0.5, label=f"{name}: engine")
        ax.plot(g.rate, [s[key] for s in pred], "s--", color=c, mfc="none", label=f"{name}: plan's prediction")
    line = (f"{name}: sag measured {sag(s['served_rate'] for s in g.real_summary):.1%}, predicted "
            f"{sag(s['served_rate'] for s in pred):.1%}")
    if name in found:
        r = found[name]
        m, sd = np.array(r["served_mean"]), np.array(r["served_sd"])
        axes[0].fill_between(r["rates"], m - sd, m + sd, color=c, alpha=0.15, lw=0,
                             label=f"{name}: search, mean ±1 sd of {r['seeds']} seeds")
        line += f", searched {r['sag']:.1%} (sd {r['sag_sd']:.1%} over {r['seeds']} seeds)"
    lines.append(line)
top = max(runs[runs.role == "sag"].rate) * 1.1 if len(candidates) else 1.0
axes[0].plot([0, top], [0, top], ":", color="grey", lw=1, label="served = offered")
axes[0].set_ylim(0, max([s["served_rate"] for s in runs.real_summary] + [1.0]) * 1.3)
for ax, ylabel in zip(axes, ("served rate (req/s)", "admission group size p95 (requests)",
                             "padding waste p95 (padded positions per real token)")):
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel(ylabel)
axes[0].set_title("Served rate")
axes[1].set_title("Admission group size, p95")
axes[2].set_title("Padding waste, p95")
axes[0].legend(loc="lower right", fontsize=6.5)
searched = f"; search on cost table {search['table']['id']}" if search else "; no sag search"
fig.suptitle(f"Sag candidates past capacity: engine (filled), the plan's predictions (open) on {TABLE}{searched}",
             fontsize=10)
S.save(fig, "03_sag", ("; ".join(lines) + ".") if lines else "The validation ran no sag candidates.")

# %% [markdown]
# ## The same mechanism, group by group
#
# Every admission group of every real run above: how deep the queue was when it was admitted, how big it was,
# how much padding it carried, and how long its prefill took beside the cost model's price for the same shape.
# Prefill time follows padded positions (rows x padded length), not the real prompt tokens.

# %%
groups = pd.concat([groups_at_admission(r.real).assign(rate=r.rate) for r in runs.itertuples()], ignore_index=True)
steps = pd.concat([admission_groups(r.real)["groups"].assign(rate=r.rate) for r in runs.itertuples()],
                  ignore_index=True)
binned = groups_by_depth(groups)
print(binned.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.8))
norm = plt.Normalize(groups.rate.min(), groups.rate.max())
jit = np.exp(np.random.default_rng(0).uniform(-0.08, 0.08, len(groups)))  # spread coinciding sizes apart
sc = a1.scatter(groups.depth, groups["size"] * jit, c=groups.rate, cmap="viridis", norm=norm, s=8, alpha=0.6)
a1.plot(np.sqrt(binned.depth_lo * binned.depth_hi), binned.size_mean, "o-", color="black", lw=1.4, ms=4,
        label="mean group size per depth bin (1, 2-3, 4-7, ...)")
a1.set_xscale("symlog", linthresh=1)
a1.set_yscale("log", base=2)
S.plain_ticks(a1)
a1.set_xlabel("queue depth at admission (requests)")
a1.set_ylabel("admission group size (requests)")
a1.set_title("Group size against queue depth")
a1.legend(loc="upper left")
a2.scatter(groups["size"] * jit, groups.waste, c=groups.rate, cmap="viridis", norm=norm, s=8, alpha=0.6)
by_size = groups.groupby("size").waste.median()
a2.plot(by_size.index, by_size, color="black", lw=1.2, label="median per size")
a2.set_xscale("log", base=2)
a2.set_yscale("symlog", linthresh=0.1)
a2.set_ylim(bottom=-0.02)
S.plain_ticks(a2)
a2.set_xlabel("admission group size (requests)")
a2.set_ylabel("padded positions per real prompt token")
a2.set_title("Padding against group size")
a2.legend(loc="upper left")
a3.scatter(steps.padded_tokens, steps.duration * 1e3, c=steps.rate, cmap="viridis", norm=norm, s=8, alpha=0.6,
           label="real prefill steps")
model = [cost.prefill(PrefillShape.padded(int(w), int(n))) * 1e3 for w, n in zip(steps["size"], steps.padded_len)]
a3.scatter(steps.padded_tokens, model, marker="x", s=10, color="0.3", lw=0.6, label="cost model, same shape")
a3.set_xscale("log")
a3.set_yscale("log")
S.plain_ticks(a3)
a3.set_xlabel("padded positions in the group (rows x padded length)")
a3.set_ylabel("prefill step time (ms)")
a3.set_title("Prefill time against padded positions")
a3.legend(loc="upper left")
fig.colorbar(sc, ax=a3, label="arrival rate of the run (req/s)")
fig.suptitle(f"Admission groups in {len(runs)} real arrival runs ({len(groups)} groups); cost model: {TABLE}",
             fontsize=10)
multi = groups[groups["size"] > 1]
deep = binned[binned.depth_lo >= 8]
ratio = np.median(steps.duration * 1e3 / np.array(model))
S.save(fig, "03_groups",
       (f"Groups admitted from a queue of 8 or more average {np.average(deep.size_mean, weights=deep.groups):.2g} "
        f"requests against {binned.size_mean.iloc[0]:.2g} from a queue of 1; " if len(deep) else
        "The queue never reached 8 at an admission in these runs; ")
       + f"groups of 2+ carry a median {multi.waste.median():.2f} padded positions per real token; a real prefill "
         f"step takes a median {ratio:.2f}x the cost model's price for its shape.")

# %% [markdown]
# ## The admission disturbance
#
# The closed run of 64 mixed requests through 8 rows. Most gaps between a running request's tokens are one
# ordinary decode step; when rows retire and new requests are admitted, the running rows also wait for the new
# group's prefill. A gap over 3x the request's own median gap is a **spike** (traces.metrics.token_gaps); each is
# lined up with the prefill step that ran inside it (traces.metrics.prefill_spikes).

# %%
dpoint = next((p for p in points if p.id == DISTURBANCE), None)
if dpoint is None:
    S.missing(vdir / "plan.json", f"the plan has no point {DISTURBANCE}; " + S.MAKE_PLAN)
druns = complete_runs(vdir, dpoint)
if not druns or druns[0].tokens.empty:
    S.missing(run_dir(vdir, dpoint, 1) / "tokens.csv", "the closed run needs per-token times; " + S.MAKE_REAL)
tg = token_gaps(druns[0])
gaps, spikes = tg["gaps"], prefill_spikes(druns[0], tg["spikes"])
pre = druns[0].steps[druns[0].steps.kind == "prefill"]
print(f"{DISTURBANCE} run 1: {len(druns[0].requests)} requests, {len(pre)} prefill steps, baseline gap "
      f"{tg['baseline_p50'] * 1e3:.1f} ms, {tg['n_spikes']} spikes (> {SPIKE_FACTOR:g}x baseline), "
      f"{(spikes.prefill < 0).sum()} without a prefill in their gap")
print(spikes.dropna(subset=["rows"]).groupby(["rows", "padded_len"]).agg(
    spikes=("gap", "size"), gap_ms=("gap", lambda g: g.median() * 1e3),
    prefill_ms=("duration", lambda d: d.median() * 1e3)).to_string(float_format=lambda v: f"{v:.1f}"))

# %%
fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, 6.8), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
ax.scatter(gaps.time, gaps.gap * 1e3, s=3, color="0.6", label="inter-token gap")
ax.scatter(spikes.time, spikes.gap * 1e3, s=16, color="tab:red", zorder=3,
           label=f"spike (> {SPIKE_FACTOR:g}x the request's baseline)")
for s in pre.itertuples():
    for a in (ax, bx):
        a.axvspan(s.start, s.end, color="tab:orange", alpha=0.18, lw=0)
ax.axhline(tg["baseline_p50"] * 1e3, color="black", ls=":", lw=1, label="baseline gap (median of requests)")
ax.set_yscale("log")
S.plain_ticks(ax, "y")
ax.set_ylabel("gap between a request's tokens (ms)")
ax.set_title(f"Every running request's token gaps; shaded: prefill steps ({DISTURBANCE}, run 1)")
ax.legend(loc="upper right")
sizes = plt.Normalize(1, max(pre["rows"].max(), 2))
bx.bar(pre.start, (pre.end - pre.start) * 1e3, width=(pre.end - pre.start), align="edge",
       color=plt.cm.viridis(sizes(pre["rows"])), edgecolor="black", lw=0.3)
for s in pre.itertuples():
    if s.end - s.start >= 0.1 * (pre.end - pre.start).max():  # label the ones big enough to see
        bx.text(s.start, (s.end - s.start) * 1e3, f"{s.rows}x{s.padded_len}", fontsize=6.5, rotation=90, va="bottom")
bx.set_ylabel("prefill step time (ms)")
bx.set_xlabel("time since the run's start (s)")
bx.set_title("The prefill steps: group size x padded length (colour: group size)")
bx.set_ylim(0, (pre.end - pre.start).max() * 1e3 * 1.45)
fig.suptitle(f"Admission disturbance: {len(druns[0].requests)} mixed requests through {dpoint.serving.max_batch} rows, "
             f"real per-token times ({druns[0].meta['device']['name']})")
S.save(fig, "03_disturbance_timeline",
       f"{tg['n_spikes']} spikes over a {tg['baseline_p50'] * 1e3:.1f} ms baseline gap, {(spikes.prefill >= 0).sum()} "
       f"of them lined up with a prefill step that ran inside the gap.")

# %% [markdown]
# ## What a spike costs
#
# Every spike in every repeat of the closed run, against the padded positions of the group whose prefill it
# waited through, and against that prefill's own time (a spike is the prefill plus one ordinary decode step).
# The simulator's spikes for the same run, on the plan's table, are the open markers.

# %%
all_spikes = pd.concat([prefill_spikes(r).assign(repeat=k) for k, r in enumerate(druns, start=1)], ignore_index=True)
sm = prefill_spikes(simulated(dpoint, detail="tokens")).dropna(subset=["rows"])
matched = all_spikes.dropna(subset=["rows"])
fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
sc = a1.scatter(matched.padded_tokens, matched.gap * 1e3, c=matched["rows"], cmap="viridis", norm=sizes, s=22,
                edgecolor="black", lw=0.3, label=f"real spikes ({len(druns)} repeats)")
a1.scatter(sm.padded_tokens, sm.gap * 1e3, s=60, facecolor="none", edgecolor="tab:blue", lw=0.8,
           label="simulator, same run")
a1.set_xscale("log", base=2)
S.plain_ticks(a1, "x")
a1.set_xlabel("padded positions of the admitted group (rows x padded length)")
a1.set_ylabel("spike: the running rows' token gap (ms)")
a1.set_title("Spike size against the group's padded positions")
a1.legend(loc="upper left")
fig.colorbar(sc, ax=a1, label="admission group size (requests)")
a2.scatter(matched.duration * 1e3, (matched.gap - matched.baseline) * 1e3, s=18, color="tab:red", edgecolor="black",
           lw=0.3, label="real spikes")
a2.scatter(sm.duration * 1e3, (sm.gap - sm.baseline) * 1e3, s=60, facecolor="none", edgecolor="tab:blue", lw=0.8,
           label="simulator")
lim = [0, max(matched.duration.max(), (matched.gap - matched.baseline).max()) * 1e3 * 1.1]
a2.plot(lim, lim, color="black", lw=0.8, label="y = x")
a2.set_xlabel("prefill step time inside the gap (ms)")
a2.set_ylabel("spike gap minus the request's baseline (ms)")
a2.set_title("Spike against the prefill that ran inside it")
a2.legend(loc="upper left")
fig.suptitle(f"Admission spikes on running requests ({DISTURBANCE}): real per-token times, simulator on {TABLE}",
             fontsize=10)
shape = ["rows", "padded_len"]
both = pd.concat([matched.groupby(shape).gap.median().rename("real"), sm.groupby(shape).gap.median().rename("sim")],
                 axis=1).dropna()
print(both.assign(error=both.sim / both.real - 1).to_string(float_format=lambda v: f"{v:.4f}"))
widest = matched[matched.padded_len == matched.padded_len.max()]
S.save(fig, "03_spikes",
       f"A group padded to {int(widest.padded_len.iloc[0])} tokens stalls running rows a median "
       f"{(widest.gap / widest['rows']).median() * 1e3:.0f} ms per row in it; per group shape the simulator's "
       f"median spike is within {(both.sim / both.real - 1).abs().max():.0%} of the real one "
       f"({len(both)} shapes)." if len(matched) and len(both) else
       "No spike in these runs lined up with a prefill step that the simulator also made.")
