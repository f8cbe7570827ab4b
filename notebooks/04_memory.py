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
# # 04 · Memory: pool size against capacity
#
# The engine reserves, at admission, every K/V block a request could ever need (prompt plus its whole
# budget). With a big pool only the batch rows limit admission; shrink the pool and the head of the queue
# starts waiting for blocks while rows sit free. This notebook finds where that happens: the simulator's
# capacity at pool sizes from 0.25 to 8 GiB, at 16 and 32 rows (paged backend, the seeded mixed workload),
# with the real small-pool validation runs laid over it when they exist.
#
# Data: the table in `SERVECAP_TABLE` (default `servecap/costs/data/h200.json`); real points from
# `SERVECAP_VALIDATION` (default `results/validation`), optional here, with the validation's own predictions
# (made from the cost table its plan names). Figures: `FIGURES_DIR`.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.sim.sweep import Workload
from servecap.traces.metrics import summary
from servecap.traces.workload import poisson_trace

table, table_file = S.load_table()
POOLS = [0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 4.0, 8.0]  # GiB: log-spaced where memory binds
ROWS = [r for r in (16, 32) if r <= table.max_batch]
BACKEND = "paged" if "paged" in table.backends else table.backends[0]
WORKLOAD = Workload(n=S.requests(), seed=0)
ROW_COLORS = dict(zip(ROWS, ["tab:purple", "tab:blue"][-len(ROWS):]))

# %% [markdown]
# ## How much memory a full batch needs
#
# A request reserves ceil((prompt + budget) / 64) blocks. Rows x the mean reservation is the pool a full
# batch of average requests holds; the largest request alone needs 68 blocks.

# %%
trace = poisson_trace(1.0, WORKLOAD.n, WORKLOAD.seed)
SERVING = ServingConfig()
blocks = np.array([SERVING.blocks_for(r.prompt_tokens + r.budget) for r in trace.requests])
full_batch_gib = {r: S.gib_of_blocks(r * blocks.mean()) for r in ROWS}
print(f"mean reservation {blocks.mean():.1f} blocks ({S.gib_of_blocks(blocks.mean()) * 1024:.0f} MiB), "
      f"largest {blocks.max()} blocks; a full batch of average requests holds "
      + ", ".join(f"{g:.2f} GiB at {r} rows" for r, g in full_batch_gib.items()))
for p in POOLS:
    n = SERVING.but(pool=PoolSize(gib=p)).pool_blocks(0)
    print(f"  {p:5g} GiB = {n:5d} blocks = {n / blocks.mean():5.1f} average requests")

# %% [markdown]
# ## The sweep
#
# Each (rows, pool) gets rates from 0.3x to 2x its saturated estimate and four more inside its capacity
# bracket. Occupancy is read at the highest rate, where the engine is saturated: the mean running rows, and
# `head_blocked_frac`, the share of the time the queue head waited for blocks while a batch row was free
# (servecap/traces/metrics.py).

# %%
t0 = time.perf_counter()
configs = [ServingConfig(backend=BACKEND, max_batch=r, pool=PoolSize(gib=p)) for r in ROWS for p in POOLS]
results, _ = S.capacity_sweep(table, configs, WORKLOAD)
print(f"{len(configs)} configurations, {sum(len(r.rows) for r in results)} simulated runs in "
      f"{time.perf_counter() - t0:.1f} s")
cap = pd.DataFrame([{"rows": r.config.max_batch, "pool_gib": r.config.pool.gib, "pool_blocks": r.pool_blocks,
                     "estimate": r.estimate, "lo": r.bracket[0], "hi": r.bracket[1],
                     **{k: max(r.rows, key=lambda x: x["rate"])[k]
                        for k in ("head_blocked_frac", "mean_running_rows", "served_rate")}}
                    for r in results])
print(cap.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def takeover(rows: int) -> float | None:
    """The smallest pool whose capacity is within 5% of the largest pool's: below it, memory sets capacity."""
    c = cap[cap["rows"] == rows].sort_values("pool_gib")
    top = c.lo.iloc[-1]
    ok = c[c.lo >= 0.95 * top]
    return float(ok.pool_gib.iloc[0]) if top == top and not ok.empty else None


bound = {r: takeover(r) for r in ROWS}

# %% [markdown]
# ## The real small-pool runs
#
# The validation plan runs the engine at a 0.5 GiB pool past the simulator's small-pool capacity (role
# `small-pool`). Each is laid over the sweep beside the validation's own prediction for the same trace and pool,
# made before the run from the cost table the plan names (which may differ from the sweep's).

# %%
real, plan_table = pd.DataFrame(), None
if S.has_validation():
    from servecap.validate.points import complete_runs

    vdir, plan, points, plan_table, _ = S.validation()
    rows = []
    for p in (p for p in points if p.role == "small-pool"):
        runs = complete_runs(vdir, p)
        if not runs:
            continue
        rate, pred = p.trace.get("rate"), plan["predictions"][p.id]
        meas = [summary(r, rate) for r in runs]
        keys = ("served_rate", "head_blocked_frac", "mean_running_rows")
        rows.append({"point": p.id, "rate": rate, "rows": p.serving.max_batch,
                     "pool_gib": S.gib_of_blocks(runs[0].meta["pool_blocks"]),
                     "repeats": len(runs), "served_rate_lo": min(m["served_rate"] for m in meas),
                     "served_rate_hi": max(m["served_rate"] for m in meas),
                     **{f"{k}_real": float(np.median([m[k] for m in meas])) for k in keys},
                     **{f"{k}_sim": pred[k] for k in keys}})
    real = pd.DataFrame(rows)
    print(real.to_string(index=False, float_format=lambda v: f"{v:.3g}") if len(real) else
          f"no complete small-pool runs in {S.rel(vdir)}")
else:
    print("no validation records (SERVECAP_VALIDATION): the figures show the simulator only")
PRED = ("validation's prediction" + (f" ({S.table_label(plan_table)})" if plan_table is not None
                                     and plan_table.table_id != table.table_id else ""))

# %% [markdown]
# ## Capacity against pool size
#
# The band is the capacity bracket, the dashed line the saturated estimate. The dotted verticals are a full
# batch of average reservations: well below it the pool, not the rows, decides how many requests run.

# %%
fig, ax = plt.subplots(figsize=(10, 5.6))
for r in ROWS:
    c = cap[cap["rows"] == r].sort_values("pool_gib")
    col = ROW_COLORS[r]
    ax.fill_between(c.pool_gib, c.lo, c.hi, color=col, alpha=0.25, lw=0)
    ax.plot(c.pool_gib, c.lo, "o-", color=col, ms=4, label=f"{r} rows: capacity bracket (sim)")
    ax.plot(c.pool_gib, c.estimate, "--", color=col, lw=1, label=f"{r} rows: saturated estimate (sim)")
    ax.axvline(full_batch_gib[r], color=col, ls=":", lw=1.2)
    ax.text(full_batch_gib[r], 0.98, f" {r} x mean\n reservation", transform=ax.get_xaxis_transform(),
            color=col, fontsize=8, va="top")  # at the top: the legend holds the bottom right
    if bound[r]:
        ax.annotate(f"95% of full capacity\nfrom {bound[r]:g} GiB", (bound[r], c[c.pool_gib == bound[r]].lo.iloc[0]),
                    xytext=(10, -32), textcoords="offset points", fontsize=8, color=col,
                    arrowprops={"arrowstyle": "->", "color": col})
if len(real):
    for _, p in real.iterrows():
        col = ROW_COLORS.get(p["rows"], "black")
        ax.errorbar(p.pool_gib, p.served_rate_real, yerr=[[p.served_rate_real - p.served_rate_lo],
                                                          [p.served_rate_hi - p.served_rate_real]],
                    color="tab:red", **S.REAL)
        ax.plot(p.pool_gib, p.served_rate_sim, "s", mfc="none", mec="tab:red", ms=9)
    first = real.loc[real.pool_gib.idxmin()]
    ax.annotate("\n".join(f"real at {p.rate:g} req/s: served {p.served_rate_real:.3g}" for _, p in real.iterrows()),
                (first.pool_gib, first.served_rate_real), xytext=(-14, 0), textcoords="offset points", ha="right",
                va="center", fontsize=7.5, color="tab:red")
    ax.plot([], [], "o", color="tab:red", mec="black", label="real engine: served rate past capacity (median, range)")
    ax.plot([], [], "s", mfc="none", mec="tab:red", label=PRED)
ax.set_xscale("log", base=2)
ax.set_xticks(POOLS, [f"{p:g}" for p in POOLS])
ax.set_xlabel("K/V pool size (GiB)")
ax.set_ylabel("arrival rate / served rate (req/s)")
ax.set_ylim(bottom=0)
ax.legend(loc="lower right")
ax.set_title(f"Capacity against pool size ({BACKEND}, {WORKLOAD.n} mixed requests, {table.device_name})")
r0 = ROWS[-1]
c0 = cap[cap["rows"] == r0].sort_values("pool_gib")
text = (f"At {r0} rows capacity climbs from {S.fmt_rate(c0.lo.iloc[0])} to {S.fmt_rate(c0.lo.iloc[-1])} req/s "
        f"({POOLS[0]:g} to {POOLS[-1]:g} GiB)")
text += f" and memory stops binding near {bound[r0]:g} GiB" if bound[r0] else ""
if len(real):
    text += (f"; real small-pool runs served {', '.join(f'{v:.3g}' for v in real.served_rate_real)} req/s "
             f"(predicted {', '.join(f'{v:.3g}' for v in real.served_rate_sim)})")
S.save(fig, "04_pool_capacity", text + ".")

# %% [markdown]
# ## What holds the queue back
#
# At saturation: the share of the time the queue head waited for blocks with a row free (left), and the rows
# actually running (right). Where the blocked share falls to zero and the rows fill, compute takes over.

# %%
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
for r in ROWS:
    c = cap[cap["rows"] == r].sort_values("pool_gib")
    col = ROW_COLORS[r]
    ax.plot(c.pool_gib, c.head_blocked_frac * 100, "o-", color=col, ms=4, label=f"{r} rows (sim)")
    ax2.plot(c.pool_gib, c.mean_running_rows, "o-", color=col, ms=4, label=f"{r} rows (sim)")
    ax2.axhline(r, color=col, ls=":", lw=1)
    for a in (ax, ax2):
        a.axvline(full_batch_gib[r], color=col, ls=":", lw=1.2)
for _, p in real.iterrows():
    ax.errorbar(p.pool_gib, p.head_blocked_frac_real * 100, color="tab:red", **S.REAL)
    ax.plot(p.pool_gib, p.head_blocked_frac_sim * 100, "s", mfc="none", mec="tab:red", ms=9)
    ax2.errorbar(p.pool_gib, p.mean_running_rows_real, color="tab:red", **S.REAL)
    ax2.plot(p.pool_gib, p.mean_running_rows_sim, "s", mfc="none", mec="tab:red", ms=9)
if len(real):
    ax.plot([], [], "o", color="tab:red", mec="black", label="real small-pool runs")
    ax.plot([], [], "s", mfc="none", mec="tab:red", label=PRED)
for a in (ax, ax2):
    a.set_xscale("log", base=2)
    a.set_xticks(POOLS, [f"{p:g}" for p in POOLS])
    a.set_xlabel("K/V pool size (GiB)")
# One legend below both panels: inside either, the long prediction label ran over the other panel's tick labels
S.legend_once(fig, (ax, ax2), ncol=2)
ax.set_ylabel("queue head blocked on memory (% of busy time)")
ax.set_title("Head of the queue waiting for blocks while a row is free")
ax2.set_ylabel("mean running rows (rows)")
ax2.set_title("Rows in use at saturation (dotted: max batch)")
fig.suptitle(f"Where the memory bound takes over from the compute bound, {table.device_name}")
c0 = cap[cap["rows"] == r0].sort_values("pool_gib")
S.save(fig, "04_memory_bound",
       f"At {r0} rows and {POOLS[0]:g} GiB the queue head waits on memory {c0.head_blocked_frac.iloc[0]:.0%} of the "
       f"time and only {c0.mean_running_rows.iloc[0]:.1f} rows run; by {POOLS[-1]:g} GiB it is "
       f"{c0.head_blocked_frac.iloc[-1]:.0%} with {c0.mean_running_rows.iloc[-1]:.1f} rows running.")
