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
# # 01 · Capacity
#
# How much load does each configuration carry, and how long do requests wait on the way there? The
# simulator replays the seeded Poisson trace (400 mixed requests) at a range of arrival rates for every decode
# backend x max batch x pool size, with padded prefill, on the cost table measured on the GPU; then the prefill
# policy (padded, packed, chunked:512) at one configuration, over several trace seeds.
#
# A rate is **stable** when the served rate keeps up with what the trace offered and the queue wait does not
# trend upward over the run (servecap/traces/metrics.py). A configuration's **capacity** is bracketed between its
# highest stable rate and the lowest unstable one; a second, finer pass of rates narrows the bracket.
#
# Data: the table in `SERVECAP_TABLE` (default `servecap/costs/data/h200.json`). Figures: `FIGURES_DIR`. Design notes:
# docs/DESIGN.md.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.policies import STUDIED, PrefillPolicy
from servecap.sim.bands import Band, exceeds_seed_spread
from servecap.sim.report import band_rows, by_config, capacity_bands, mean_result, mechanism
from servecap.sim.sweep import Workload, run_sweep

table, table_file = S.load_table()
BACKENDS = table.backends
MAX_BATCH = [b for b in (8, 16, 32) if b <= table.max_batch]
LARGE, SMALL = 64.0, 0.5  # GiB: a pool that never binds at 32 rows, and the write-up's small pool
POOLS = [LARGE, SMALL]
WORKLOAD = Workload(n=S.requests(), seed=0)
FINE = 4  # extra rates inside each bracket

# %% [markdown]
# ## The sweep
#
# Each configuration's rates span 0.3x to 2x its saturated estimate (the rate it serves with every request
# queued at t=0); then `FINE` more rates go inside each capacity bracket.

# %%
configs = [ServingConfig(backend=b, max_batch=mb, pool=PoolSize(gib=pool)) for pool in POOLS for b in BACKENDS
           for mb in MAX_BATCH]
t0 = time.perf_counter()
results, _ = S.capacity_sweep(table, configs, WORKLOAD, fine=FINE)
print(f"{len(configs)} configurations, {sum(len(r.rows) for r in results)} simulated runs in "
      f"{time.perf_counter() - t0:.1f} s")

rows = pd.DataFrame([{**r, "label": res.config.label} for res in results for r in res.rows]).sort_values(
    ["backend", "max_batch", "pool_gib", "rate"])
cap = pd.DataFrame([{"backend": r.config.backend, "max_batch": r.config.max_batch, "pool_gib": r.config.pool.gib,
                     "pool_blocks": r.pool_blocks, "saturated_estimate": r.estimate, "capacity_lo": r.bracket[0],
                     "capacity_hi": r.bracket[1]} for r in results])
cap["name"] = [f"{b}, {mb} rows, {p:g} GiB" for b, mb, p in zip(cap.backend, cap.max_batch, cap.pool_gib)]
print(cap.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


# %% [markdown]
# ## Served rate against arrival rate
#
# Below capacity the served rate follows the offered rate (the dotted line); past it, it levels off or sags.
# The shaded band is each configuration's capacity bracket.

# %%
BATCH_COLORS = dict(zip(MAX_BATCH, ["tab:green", "tab:purple", "tab:blue"][-len(MAX_BATCH):]))


def pool_name(gib: float) -> str:
    return f"pool {gib:g} GiB" + (" (never binds)" if gib == LARGE else "")


def panels(title: str):
    fig, axes = plt.subplots(len(POOLS), len(BACKENDS), figsize=(6 * len(BACKENDS), 4.2 * len(POOLS)),
                             squeeze=False, sharex=True)
    for i, pool in enumerate(POOLS):
        for j, b in enumerate(BACKENDS):
            axes[i, j].set_title(f"{b} backend, {pool_name(pool)}")
    for a in axes[-1]:
        a.set_xlabel("arrival rate (req/s)")
    fig.suptitle(title)
    return fig, axes


def bracket_band(ax, res, color):
    lo, hi = res.bracket
    if lo is not None and hi is not None:
        ax.axvspan(lo, hi, color=color, alpha=0.15, lw=0)


def configurations(axes):
    """Each panel (pool x backend) with its configurations: (axes, result, its rows by rate, its colour)."""
    for i, pool in enumerate(POOLS):
        for j, b in enumerate(BACKENDS):
            for res in (r for r in results if r.config.pool.gib == pool and r.config.backend == b):
                yield axes[i, j], res, pd.DataFrame(res.rows).sort_values("rate"), BATCH_COLORS[res.config.max_batch]


fig, axes = panels(f"Served rate against arrival rate ({WORKLOAD.n} mixed requests, {table.device_name})")
for ax, res, d, c in configurations(axes):
    lo, hi = res.bracket
    ax.plot(d.rate, d.served_rate, color=c, marker=".", ms=4, **S.SIM,
            label=f"max batch {res.config.max_batch}: capacity {S.fmt_rate(lo)}-{S.fmt_rate(hi)} req/s")
    bracket_band(ax, res, c)
for ax in axes.flat:
    top = rows.rate.max() * 1.05
    ax.plot([0, top], [0, top], ":", color="grey", lw=1, label="served = offered")
    ax.set_xlim(0, top)
    ax.set_ylim(0, rows.served_rate.max() * 1.1)
    ax.set_ylabel("served rate (req/s)")
    ax.legend(loc="upper left")
best = cap.loc[cap.capacity_lo.fillna(0).idxmax()]
small = cap[(cap.backend == best.backend) & (cap.max_batch == best.max_batch) & (cap.pool_gib == SMALL)].iloc[0]
S.save(fig, "01_served_rate",
       f"Highest capacity: {best['name']}, stable to "
       f"{S.fmt_rate(best.capacity_lo)} req/s (unstable at {S.fmt_rate(best.capacity_hi)}); the {SMALL:g} GiB pool "
       f"holds the same configuration to {S.fmt_rate(small.capacity_lo)} req/s.")

# %% [markdown]
# ## Queue wait against arrival rate
#
# The median (solid) and 95th percentile (dashed) time from arrival to admission. Waits stay near zero up
# to capacity and then grow with the queue (the axis is linear below 1 ms and logarithmic above).

# %%
fig, axes = panels(f"Queue wait against arrival rate ({WORKLOAD.n} mixed requests, {table.device_name})")
for ax, res, d, c in configurations(axes):
    ax.plot(d.rate, d.queue_wait_p50 * 1e3, color=c, marker=".", ms=4, **S.SIM, label=f"max batch {res.config.max_batch}")
    ax.plot(d.rate, d.queue_wait_p95 * 1e3, color=c, ls="--", lw=1.2)
    bracket_band(ax, res, c)
for ax in axes.flat:
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("queue wait (ms): p50 solid, p95 dashed")
    ax.legend(loc="upper left")
at = rows[(rows.backend == best.backend) & (rows.max_batch == best.max_batch) & (rows.pool_gib == best.pool_gib)]
at_lo = at[at.rate == best.capacity_lo].iloc[0] if (at.rate == best.capacity_lo).any() else None
S.save(fig, "01_queue_wait",
       (f"At its capacity ({S.fmt_rate(best.capacity_lo)} req/s) the best configuration's median request waits "
        f"{at_lo.queue_wait_p50 * 1e3:.0f} ms and the p95 {at_lo.queue_wait_p95 * 1e3:.0f} ms; past it the waits grow "
        f"for as long as requests keep coming." if at_lo is not None else
        "Queue waits stay near zero below capacity and grow with the queue past it."))

# %% [markdown]
# ## Capacity of every configuration
#
# The bracket (bar: highest stable to lowest unstable rate) beside the saturated estimate (x), the rate the
# engine serves when every request is queued from the start. Saturation makes the biggest admission groups,
# so where padding is expensive the estimate sits below the bracket.

# %%
cap = cap.sort_values(["pool_gib", "backend", "max_batch"], ascending=[False, True, True]).reset_index(drop=True)
fig, ax = plt.subplots(figsize=(10, 0.42 * len(cap) + 1.6))
for k, r in cap.iterrows():
    c = S.COLORS.get(r.backend, "tab:gray")
    if pd.notna(r.capacity_lo) and pd.notna(r.capacity_hi):
        ax.barh(k, r.capacity_hi - r.capacity_lo, left=r.capacity_lo, color=c, height=0.6,
                alpha=0.75 if r.pool_gib == LARGE else 0.4)
        ax.text(r.capacity_hi, k, f"  {r.capacity_lo:.3g}-{r.capacity_hi:.3g}", va="center", fontsize=8)
    else:
        ax.text(r.saturated_estimate, k, f"  bracket open: {S.fmt_rate(r.capacity_lo)}-{S.fmt_rate(r.capacity_hi)}",
                va="center", fontsize=8)
    ax.plot(r.saturated_estimate, k, "x", color="black", ms=6)
ax.set_yticks(range(len(cap)), cap.name)
ax.invert_yaxis()
ax.set_xlabel("arrival rate (req/s)")
ax.set_xlim(0, cap[["capacity_hi", "saturated_estimate"]].max().max() * 1.2)
ax.set_title(f"Capacity bracket per configuration (bar) and saturated estimate (x), {table.device_name}")
ratio = (best.capacity_lo / small.capacity_lo) if small.capacity_lo else float("nan")
worst = cap.loc[cap.capacity_lo.fillna(np.inf).idxmin()]
S.save(fig, "01_capacity_summary",
       f"Capacity ranges from {S.fmt_rate(worst.capacity_lo)} req/s ({worst['name']}) to "
       f"{S.fmt_rate(best.capacity_lo)} ({best['name']}); the {SMALL:g} GiB pool holds that configuration "
       f"{ratio:.1f}x lower.")

# %% [markdown]
# ## The prefill policy, with the seed band
#
# One seeded trace is one sample of the workload: the same configuration on another seed serves a few percent
# more or less, so a difference between configurations means something only beyond that spread
# (`sim.bands.exceeds_seed_spread`). Here the best configuration above runs each prefill policy on several trace
# seeds, at the same rates from 0.7x to 1.6x that configuration's capacity, close enough together (about 6%
# apart) to tell the policies' brackets apart. Lines are the mean over seeds, shaded bands the lowest to the
# highest seed. A table that measured only
# padded prefill steps prices packed and chunked steps from them by their shape (servecap/costs/model.py); the figure
# says so where it does.

# %%
POLICIES = list(STUDIED)
SEEDS = list(range(5))
t0 = time.perf_counter()
POLICY_RATES = [float(f"{r:.3g}") for r in np.geomspace(0.7, 1.6, 14) * best.capacity_lo]
best_config = ServingConfig(backend=best.backend, max_batch=int(best.max_batch), pool=PoolSize(gib=LARGE))
policy_results, warned = run_sweep(table, [best_config.but(prefill=p) for p in POLICIES],
                                   POLICY_RATES, WORKLOAD, seeds=SEEDS, jobs=S.jobs(), progress=False)
print(f"{len(POLICIES)} policies x {len(SEEDS)} seeds, {sum(len(r.rows) for r in policy_results)} simulated runs in "
      f"{time.perf_counter() - t0:.1f} s")
for w in warned:
    print("cost model:", w)
seeds_of = {str(g[0].config.prefill): g for g in by_config(policy_results)}
for policy, group in seeds_of.items():
    print(f"\n{policy}: {capacity_bands(group)}")
    for line in mechanism(mean_result(group), group):
        print("  -", line)
derived = [p for p in POLICIES if PrefillPolicy.parse(p).name not in table.policies]

# %%
fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 5.6), gridspec_kw={"width_ratios": [1, 1, 0.8]})
for i, (policy, group) in enumerate(seeds_of.items()):
    c = S.policy_color(policy)
    b = pd.DataFrame(band_rows(group))
    for ax, k, x in ((a1, "served_rate", 1), (a2, "queue_wait_p50", 1e3)):  # queue wait in ms
        ax.plot(b.rate, b[f"{k}_mean"] * x, color=c, marker=".", ms=4, **S.SIM,
                label=policy + (" (priced from padded steps)" if policy in derived else ""))
        ax.fill_between(b.rate, b[f"{k}_min"] * x, b[f"{k}_max"] * x, color=c, alpha=0.2, lw=0)
    for j, res in enumerate(group):
        lo, hi = res.bracket
        y = i + (j - (len(group) - 1) / 2) * 0.6 / len(group)
        a3.plot([lo or 0, hi or lo or 0], [y, y], color=c, lw=2.5, solid_capstyle="butt")
        a3.text(hi or lo or 0, y, f" seed {res.seed}", va="center", fontsize=6.5, color="0.35")
top = max(r["rate"] for res in policy_results for r in res.rows) * 1.05
a1.plot([0, top], [0, top], ":", color="grey", lw=1, label="served = offered")
a1.set_xlim(POLICY_RATES[0] * 0.95, top)
a1.set_ylim(POLICY_RATES[0] * 0.8, None)
a1.set_ylabel("served rate (req/s)")
a1.set_title("Served rate: mean of the seeds, min-max shaded")
a2.set_yscale("symlog", linthresh=1)
a2.set_ylim(bottom=0)
a2.set_ylabel("queue wait p50 (ms)")
a2.set_title("Queue wait p50: mean of the seeds, min-max shaded")
for ax in (a1, a2):
    ax.set_xlabel("arrival rate (req/s)")
    ax.legend(loc="upper left")
a3.set_yticks(range(len(seeds_of)), list(seeds_of))
a3.invert_yaxis()
a3.set_xlabel("capacity bracket (req/s): highest stable to lowest unstable rate")
a3.set_title("Capacity bracket, one bar per trace seed")
note = f"; {', '.join(derived)} priced from the table's padded steps, not measured" if derived else ""
fig.suptitle(f"Prefill policies, {best['name']}: {WORKLOAD.n} mixed requests x {len(SEEDS)} trace seeds, "
             f"{table.device_name}{note}")
lows = {p: [res.bracket[0] for res in g] for p, g in seeds_of.items()}
parts = [f"{p} {Band.of(v).mean:.3g} (seeds {Band.of(v).min:.3g}-{Band.of(v).max:.3g})" for p, v in lows.items()]
versus = []
for p in POLICIES[1:]:
    a, b = lows[POLICIES[0]], lows[p]
    if None not in a + b:
        beyond = exceeds_seed_spread(b, a, paired=True)
        versus.append(f"{p} against {POLICIES[0]}: {'beyond' if beyond else 'within'} the seed spread")
S.save(fig, "01_prefill_policies",
       "Highest stable rate, mean over seeds: " + "; ".join(parts) + (". Paired by seed, " + "; ".join(versus)
                                                                      if versus else "") + ".")
