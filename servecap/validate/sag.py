"""The sag search: where in the space a user could be in does the served rate fall past capacity, in the mean
over many trace seeds (one seed's dip is sampling, not a sag)?

The space: prompt-length mixes, budget distributions (fixed, lattice, uniform, short), max batch, pool size and
prefill policy (traces.workload.synthetic_trace makes the workloads). Each configuration is run at rates from
below to far past its saturated estimate, for several seeds; its sag is the fall of the seed-mean served rate
from its peak to the highest rate, over the peak. A screen with few seeds ranks every configuration; the
strongest are run again with more seeds and more rates, and the two strongest that a real engine of this table
can run (rows within the table's measured range) become the candidates the validation plan runs for real.
"""
from __future__ import annotations

import itertools
import json
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from servecap.costs.model import CostModel
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.core.policies import STUDIED
from servecap.sim import inputs
from servecap.sim.simulator import SimConfig, simulate
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.metrics import served_rate, summary
from servecap.traces.outpath import check_new_file
from servecap.traces.provenance import provenance
from servecap.traces.workload import synthetic_trace

PROMPTS = ("five", "loguniform", "bimodal")
BUDGETS = ("lattice", "uniform", "short", "fixed:32", "fixed:128")
MAX_BATCH = (8, 16, 32, 64)
POOLS = (None, 1.0)  # None: a pool that never binds
SCREEN = dict(seeds=2, n=200, factors=(0.6, 0.8, 1.0, 1.25, 1.6, 2.2, 3.0))
REFINE = dict(seeds=12, n=400, factors=(0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0, 2.6, 3.4))
SAG = 0.10


@dataclass(frozen=True)
class Case:
    prompts: str
    budgets: str
    max_batch: int
    pool_gib: float | None
    prefill: str

    @property
    def serving(self) -> ServingConfig:
        return ServingConfig(max_batch=self.max_batch, pool=PoolSize(gib=self.pool_gib), prefill=self.prefill)

    @property
    def name(self) -> str:
        pool = "pool-ample" if self.pool_gib is None else f"pool-{self.pool_gib:g}gib"
        return f"{self.prompts}-{self.budgets.replace(':', '')}-b{self.max_batch}-{pool}-{self.prefill.replace(':', '')}"


_cost: CostModel | None = None


def _init(table) -> None:
    global _cost
    warnings.simplefilter("ignore")  # extrapolation past the measured rows is named in the report instead
    _cost = CostModel(table)


def _run(case: Case, rate: float | None, seed: int, n: int) -> dict:
    """One simulated point (rate None: every request at t=0, for the saturated estimate)."""
    trace = synthetic_trace(rate or 1.0, n, seed, case.prompts, case.budgets)
    if rate is None:
        from servecap.sim.inputs import closed
        trace = closed(trace)
    rec = simulate(trace, _cost, SimConfig(case.serving)).record
    if rate is None:
        return {"served_rate": served_rate(rec)}
    s = summary(rec, rate)
    return {k: s[k] for k in ("served_rate", "stable", "queue_wait_p50", "group_size_p50", "group_size_p95",
                              "padding_waste_p50", "padding_waste_p95", "mean_running_rows", "head_blocked_frac")}


def _curve(pool, case: Case, seeds: int, factors, n: int) -> dict:
    est = pool_map(pool, _run, [(case, None, 0, n)])[0]["served_rate"]
    rates = [float(f"{f * est:.3g}") for f in factors]
    args = [(case, r, s, n) for r in rates for s in range(seeds)]
    rows = pool_map(pool, _run, args)
    by_rate = {r: [row for (c, rr, s, _), row in zip(args, rows) if rr == r] for r in rates}
    mean = [float(np.mean([x["served_rate"] for x in by_rate[r]])) for r in rates]
    sd = [float(np.std([x["served_rate"] for x in by_rate[r]], ddof=1)) if seeds > 1 else 0.0 for r in rates]
    peak = int(np.argmax(mean))
    return {"case": asdict(case), "name": case.name, "estimate": est, "rates": rates, "served_mean": mean,
            "served_sd": sd, "peak_rate": rates[peak], "peak": mean[peak],
            "sag": (mean[peak] - mean[-1]) / mean[peak], "sag_sd": sd[-1] / mean[peak],
            "groups_p95": [float(np.mean([x["group_size_p95"] for x in by_rate[r]])) for r in rates],
            "waste_p95": [float(np.mean([x["padding_waste_p95"] for x in by_rate[r]])) for r in rates],
            "rows_mean": [float(np.mean([x["mean_running_rows"] for x in by_rate[r]])) for r in rates],
            "seeds": seeds}


def pool_map(pool, fn, args: list[tuple]) -> list:
    return list(pool.map(fn, *zip(*args))) if pool else [fn(*a) for a in args]


def search(table_path: Path | None, out: Path, *, jobs: int | None = None, force: bool = False, top: int = 8,
           progress=print) -> dict:
    out = Path(out)
    if (out / "search.json").exists() and not force:
        raise InputError("already holds a sag search; choose another --out or pass --force", path=out / "search.json")
    table = inputs.load_table(table_path)
    cases = [Case(*c) for c in itertools.product(PROMPTS, BUDGETS, MAX_BATCH, POOLS, STUDIED)]
    jobs = jobs or os.cpu_count() or 1
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(table,)) as pool:
        screen = []
        for i, c in enumerate(cases):
            screen.append(_curve(pool, c, SCREEN["seeds"], SCREEN["factors"], SCREEN["n"]))
            if (i + 1) % 20 == 0:
                progress(f"screened {i + 1}/{len(cases)}")
        ranked = sorted(screen, key=lambda r: -r["sag"])
        refined = [_curve(pool, Case(**r["case"]), REFINE["seeds"], REFINE["factors"], REFINE["n"])
                   for r in ranked[:top]]
    refined.sort(key=lambda r: -r["sag"])
    runnable = [r for r in refined if r["case"]["max_batch"] <= table.max_batch]
    doc = {"table": {"id": table.table_id, "device": table.device_name}, "screen": SCREEN,
           "refine": REFINE, "threshold": SAG, "space": {"prompts": PROMPTS, "budgets": BUDGETS, "max_batch": MAX_BATCH,
                                                          "pool_gib": POOLS, "policies": STUDIED},
           "screened": screen, "refined": refined, **provenance()}
    atomic_write_text(out / "search.json", json.dumps(doc, indent=1, default=float) + "\n")
    atomic_write_text(out / "candidates.json", json.dumps(candidates(runnable[:2], REFINE["n"]), indent=1) + "\n")
    return doc


def candidates(curves: list[dict], n: int) -> list[dict]:
    """The configurations the real engine runs: a rate before the peak, the peak, and two past it."""
    out = []
    for r in curves:
        c, rates, peak = r["case"], r["rates"], r["rates"].index(r["peak_rate"])
        last = len(rates) - 1
        chosen = sorted({rates[max(0, peak - 2)], rates[peak], rates[min(last, (peak + last + 1) // 2)], rates[last]})
        out.append({"name": r["name"], "max_batch": c["max_batch"], "pool_gib": c["pool_gib"], "prefill": c["prefill"],
                    "trace": {"kind": "synthetic", "n": n, "seed": 0, "prompts": c["prompts"], "budgets": c["budgets"]},
                    "rates": chosen, "sag_sim_seed_mean": r["sag"]})
    return out


def write_report(doc: dict, out: Path) -> Path:
    """search.md and sag.png: the extent of the search, the strongest sags with their seed spread, and what
    changes with load in each (admission groups, padding, rows running)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    sp, refined = doc["space"], doc["refined"]
    found = [r for r in refined if r["sag"] >= doc["threshold"]]
    lines = [f"# Sag search on cost table {doc['table']['id']} ({doc['table']['device']})", "",
             f"Space: prompts {', '.join(sp['prompts'])}; budgets {', '.join(sp['budgets'])}; max batch "
             f"{', '.join(map(str, sp['max_batch']))}; pool {', '.join('ample' if p is None else f'{p:g} GiB' for p in sp['pool_gib'])}; "
             f"prefill {', '.join(sp['policies'])}: {len(doc['screened'])} configurations. "
             f"Screen: {doc['screen']['n']}-request traces, {doc['screen']['seeds']} seeds x {len(doc['screen']['factors'])} rates "
             f"({doc['screen']['factors'][0]}x to {doc['screen']['factors'][-1]}x the saturated estimate); the "
             f"{len(refined)} strongest again with {doc['refine']['n']}-request traces, {doc['refine']['seeds']} seeds x "
             f"{len(doc['refine']['factors'])} rates "
             f"(to {doc['refine']['factors'][-1]}x). Sag = (peak of the seed-mean served rate - its value at the highest "
             f"rate) / peak; a sag counts at >= {doc['threshold']:.0%}.", "",
             f"Found: {len(found)} of the {len(refined)} refined configurations sag by {doc['threshold']:.0%} or more."
             + (" Rows above the table's measured 32 are extrapolated by the cost model." if any(
                 r["case"]["max_batch"] > 32 for r in refined) else ""), "",
             "| configuration | sag (seed sd) | peak req/s at rate | group p95 at peak -> last | padding waste p95 "
             "at peak -> last | rows running at peak -> last |", "|---|---|---|---|---|---|"]
    for r in refined:
        i = r["rates"].index(r["peak_rate"])
        lines.append(f"| {r['name']} | {r['sag']:.1%} ({r['sag_sd']:.1%}) | {r['peak']:.1f} at {r['peak_rate']:g} | "
                     f"{r['groups_p95'][i]:.1f} -> {r['groups_p95'][-1]:.1f} | {r['waste_p95'][i]:.2f} -> "
                     f"{r['waste_p95'][-1]:.2f} | {r['rows_mean'][i]:.1f} -> {r['rows_mean'][-1]:.1f} |")
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in refined[:4]:
        m, sd = np.array(r["served_mean"]), np.array(r["served_sd"])
        ax.plot(r["rates"], m, "o-", label=f"{r['name']} (sag {r['sag']:.0%})")
        ax.fill_between(r["rates"], m - sd, m + sd, alpha=0.2)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel(f"served rate, mean of {doc['refine']['seeds']} seeds +/- sd (req/s)")
    ax.set_title(f"Served rate past capacity, the {min(4, len(refined))} largest simulated falls (table {doc['table']['id']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sag.png", dpi=110)
    plt.close(fig)
    lines += ["", "![served rate past capacity](sag.png)", ""]
    atomic_write_text(out / "search.md", "\n".join(lines))
    return out / "search.md"


def compare_real(validation: Path, out: Path, table_path: Path | None, allow_nonstationary: bool = False,
                 force: bool = False) -> Path:
    """comparison.md and comparison.png: each candidate's served rate against rate, predicted at plan time (seed 0,
    the trace the engine ran) and measured, with the sag of each and the search's seed-mean curve beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import _sag, _sag_groups, compare

    for name in ("comparison.md", "comparison.png"):
        check_new_file(Path(out) / name, force=force)
    plan, results = compare(Path(validation), table_path, allow_nonstationary)
    groups = _sag_groups(results)
    if not groups:
        raise InputError("the validation has no graded sag points", path=validation)
    search = json.loads((Path(out) / "search.json").read_text())
    curves = {r["name"]: r for r in search["refined"]}
    planned = {}
    for p in plan["points"]:
        if p["role"] == "sag":
            planned.setdefault(p["id"].rsplit("-rate-", 1)[0].removeprefix("sag-"), []).append(p["trace"]["rate"])
    lines = [f"# The sag on the real engine: predicted at plan time (table {plan['table']['id']}) and measured", "",
             "Sag = (peak served rate - served rate at the highest rate) / peak, over the rates that ran. The predictions "
             "are the simulator's for the very trace the engine ran (seed 0); the search's seed-mean curve (results/sag/"
             "search.json, another table and 400-request traces of 12 seeds) shows how much one seed can differ.", "",
             "| candidate | rates run (of planned) | served predicted | served measured | sag predicted | sag measured | "
             "within 25% |", "|---|---|---|---|---|---|---|"]
    fig, ax = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.8), squeeze=False)
    for a, (name, cs) in zip(ax[0], groups.items()):
        rates = [c.rate for c in cs]
        pred, meas = [c.sim["served_rate"] for c in cs], [c.measured["served_rate"] for c in cs]
        sp, sm = _sag(pred), _sag(meas)
        lines.append(f"| {name} | {', '.join(f'{r:g}' for r in rates)} (of {', '.join(f'{r:g}' for r in planned[name])}) "
                     f"| {', '.join(f'{v:.1f}' for v in pred)} | {', '.join(f'{v:.1f}' for v in meas)} | {sp:.1%} | "
                     f"{sm:.1%} | {'yes' if sm > 0 and abs(sp - sm) <= 0.25 * sm else 'no'} |")
        device = cs[0].meta[0]["device"]["name"]
        a.plot(rates, meas, "o-", label=f"measured ({device}), seed 0")
        a.plot(rates, pred, "s--", mfc="none", label="predicted at plan time, seed 0")
        if name in curves:
            r = curves[name]
            m, sd = np.array(r["served_mean"]), np.array(r["served_sd"])
            a.plot(r["rates"], m, ":", color="grey", label=f"search: mean of {r['seeds']} seeds")
            a.fill_between(r["rates"], m - sd, m + sd, color="grey", alpha=0.2, label="search: +/- 1 sd")
        a.set(xlabel="arrival rate (req/s)", ylabel="served rate (req/s)", title=f"{name}: served rate past capacity")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out) / "comparison.png", dpi=110)
    plt.close(fig)
    lines += ["", "![served rate past capacity, predicted and measured](comparison.png)", ""]
    atomic_write_text(Path(out) / "comparison.md", "\n".join(lines))
    return Path(out) / "comparison.md"
