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
# # 06 · Replicas: how many engines a rate needs, and what the router does to the tail
#
# The question after "how much does one engine carry?": how many engines does this traffic need, and how should
# requests be routed? Each replica is one engine of the table's kind (its own rows, pool and scheduler) behind a
# router (servecap/core/routing.py: round-robin, least-outstanding, least-tokens); the simulator's fleet (servecap/sim/fleet.py)
# runs them on one clock. A rate is held when the run meets the SLOs below (servecap/traces/metrics.py: at most 1% of
# requests miss one, the served rate keeps up, the named tails are within their limits). Rates are multiples of
# one engine's saturated estimate, so the notebook reads any table.
#
# The real two-replica runs and their predictions are in notebook 02 (the "fleet" group).
#
# Data: the table in `SERVECAP_TABLE` (default `servecap/costs/data/h200.json`). Figures: `FIGURES_DIR`.

# %%
import _style as S  # noqa: I001  (first: puts the repository on the path, sets the backend)
import time

import matplotlib.pyplot as plt
import pandas as pd

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.routing import ROUTERS
from servecap.sim.fleet_report import fewest_replicas
from servecap.sim.sweep import Workload, run_sweep
from servecap.traces.slo import limit_ms, parse_slos

table, table_file = S.load_table()
BACKEND = "paged" if "paged" in table.backends else table.backends[0]
ROWS = min(32, table.max_batch)
POOL_GIB = 4.0
REPLICAS = [1, 2, 3, 4]
SLOS = parse_slos("ttft_p99=0.5,tpot_p99=0.01")
# Fleet rates need longer traces than one engine's: a few hundred requests at a fleet's rate span a few seconds,
# too short for the stability check.
WORKLOAD = Workload(n=5 * S.requests(), seed=0)

# %% [markdown]
# ## One engine's saturated rate sets the grid

# %%
t0 = time.perf_counter()
ONE = ServingConfig(backend=BACKEND, max_batch=ROWS, pool=PoolSize(gib=POOL_GIB))
one, _ = run_sweep(table, [ONE], None, WORKLOAD, jobs=S.jobs(), progress=False)
estimate = one[0].estimate
RATES = [float(f"{f * estimate:.3g}") for f in (0.8, 1.6, 2.4, 3.2, 4.0)]
configs = [ONE.but(replicas=n, router=r) for r in ROUTERS for n in REPLICAS]
results, warned = run_sweep(table, configs, RATES, WORKLOAD, jobs=S.jobs(), progress=False, slos=SLOS)
for w in warned:
    print("cost model:", w)
points = pd.DataFrame([{**r, "router": res.config.router, "replicas": res.config.replicas}
                       for res in results for r in res.rows])
print(f"one engine saturates near {estimate:.1f} req/s; {len(configs)} fleets x {len(RATES)} rates "
      f"({WORKLOAD.n} requests each) in {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ## The fewest replicas that hold each rate

# %%
found = pd.DataFrame(fewest_replicas(results, SLOS))
need = found.pivot(index="rate", columns="router", values="replicas")
print(need.to_string())

fig, ax = plt.subplots(figsize=(7.5, 4.2))
for k, router in enumerate(ROUTERS):
    held = need[router].dropna()
    ax.plot(held.index, held.values + (k - 1) * 0.04, marker="o", drawstyle="steps-post", label=router,
            color=S.ROUTER_COLORS[router])
    lost = need[router][need[router].isna()]
    ax.plot(lost.index, [max(REPLICAS) + 0.5] * len(lost), ls="none", marker="x", color=S.ROUTER_COLORS[router])
ax.set_xlabel("offered rate (requests/s)")
ax.set_ylabel("fewest replicas within the SLOs")
ax.set_yticks(REPLICAS + [max(REPLICAS) + 0.5], [str(n) for n in REPLICAS] + [f"> {max(REPLICAS)}"])
ax.grid(alpha=0.3)
ax.legend(title="router")
ax.set_title(f"Simulated fewest replicas within the SLOs by offered rate, per router\n"
             f"({', '.join(map(str, SLOS))}; {BACKEND}, {ROWS} rows, {POOL_GIB:g} GiB each)", fontsize=10)
S.save(fig, "06_replicas_needed",
       f"Simulated on {S.table_label(table)}, Poisson traces of {WORKLOAD.n} requests at multiples of one "
       f"engine's saturated rate ({estimate:.1f} req/s); x: no tested count up to {max(REPLICAS)} held the rate. "
       f"Lines offset slightly so that equal counts stay visible.")

# %% [markdown]
# ## Routing and the tail
#
# Below saturation every router serves the offered rate, but not with the same waits: a load-aware router sends
# back-to-back arrivals to the replica that is behind, and the second waits out the first's prefill.

# %%
fig, axes = plt.subplots(1, len(REPLICAS) - 1, figsize=(12, 4), sharey=True)
for ax, n in zip(axes, REPLICAS[1:]):
    for router in ROUTERS:
        d = points[(points.replicas == n) & (points.router == router)].sort_values("rate")
        ax.plot(d.rate, d.ttft_p99 * 1e3, marker="o", color=S.ROUTER_COLORS[router], label=router)
    ax.axhline(SLOS[0].limit_s * 1e3, color="0.5", ls=":", label=f"{SLOS[0].name} <= {limit_ms(SLOS[0])}")
    ax.set_yscale("log")
    S.plain_ticks(ax, "y")
    ax.set_title(f"{n} replicas")
    ax.set_xlabel("offered rate (requests/s)")
    ax.grid(alpha=0.3, which="both")
axes[0].set_ylabel("TTFT p99 (ms)")
S.legend_once(fig, axes, ncol=4)
fig.suptitle("Simulated TTFT p99 by router and offered rate, 2-4 replicas", fontsize=11)
S.save(fig, "06_tail_ttft",
       f"Simulated on {S.table_label(table)}, {WORKLOAD.n} requests a point; dotted: the TTFT SLO.")

# %%
below = points[points.rate <= RATES[1]].pivot_table(index=["replicas", "rate"], columns="router",
                                                    values="ttft_p99")
print("TTFT p99 (ms) at the two lowest rates, by router:")
print((below * 1e3).round(1).to_string())
