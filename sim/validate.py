"""Validation: the simulator's predictions beside real engine runs of the same traces.

Three steps, each its own command so the GPU is needed for one of them only:

    python -m sim validate plan   --out results/validation          # CPU: choose the points from the sim's sweep
    python -m sim validate real   --out results/validation          # GPU: run them on the engine (resumes)
    python -m sim validate report --out results/validation          # CPU: predicted beside measured, with errors

`plan` writes plan.json (and the Azure window trace it chose); `real` writes one run record per point and
repeat under real/; `report` simulates every point on the cost table, scores both with traces.metrics, and
writes report.md, points.csv and validation.png. Re-running the report from committed records needs no GPU.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from calibrate.cost_model import CostModel
from engine.block_pool import blocks_for_gib
from traces.csvio import atomic_write_text
from traces.errors import InputError
from traces.importers import ImportOptions, import_azure
from traces.metrics import capacity_bracket, closed_run, summary
from traces.provenance import provenance
from traces.records import read_run
from traces.trace_io import read_trace, write_trace
from traces.workload import Trace, closed_mixed, closed_uniform, poisson_trace

from . import inputs
from .model import SimConfig, simulate
from .sweep import Config, Workload, run_sweep

AZURE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"
FIGURES = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50",
           "group_size_p50", "group_size_p95", "group_size_max", "padding_waste_p50", "padding_waste_p95")
ABS_FLOOR = {"queue_wait_p50": 0.02}  # seconds: below this a relative error of a near-zero wait means little


@dataclass
class Point:
    id: str
    role: str  # below / near / past (the capacity curve), small-pool, backend, closed, azure
    trace: dict  # how to rebuild the trace: poisson / closed-mixed / closed-uniform / file
    backend: str = "paged"
    max_batch: int = 32
    pool_gib: float | None = None  # None: the engine's own (large) pool
    warmup: int = 0
    repeats: int = 1
    tokens: bool = False  # record every token's time (the closed controls, for the inter-token gaps)


def build_trace(spec: dict, root: Path) -> Trace:
    kind = spec["kind"]
    if kind == "poisson":
        return poisson_trace(spec["rate"], spec["n"], spec["seed"])
    if kind == "closed-mixed":
        return closed_mixed(spec["n"], spec["seed"])
    if kind == "closed-uniform":
        return closed_uniform(spec["prompt"], spec["n"], spec["budget"])
    if kind == "file":
        return read_trace(root / spec["path"])
    raise InputError(f"unknown trace kind {kind!r} in the validation plan")


def load_plan(out: Path) -> tuple[dict, list[Point]]:
    path = out / "plan.json"
    if not path.exists():
        raise InputError("no validation plan here; make one with `python -m sim validate plan`", path=path)
    plan = json.loads(path.read_text())
    return plan, [Point(**p) for p in plan["points"]]


def _round(x: float) -> float:
    return float(f"{x:.2g}")


def _capacity(table: dict, config: Config, workload: Workload) -> tuple[float, list[dict]]:
    """The simulator's highest stable rate for `config`, from a fine sweep around its saturated estimate."""
    res, _ = run_sweep(table, [config], None, workload, progress=False)
    rough = res[0].bracket[0] or res[0].estimate
    fine, _ = run_sweep(table, [config], list(np.round(np.geomspace(0.5 * rough, 2.5 * rough, 24), 2)), workload,
                        progress=False)
    lo, hi = fine[0].bracket
    return (lo or fine[0].rates[0]), sorted(fine[0].rows, key=lambda r: r["rate"])


def make_plan(table_path: Path | None, out: Path, n: int = 400, seed: int = 0, azure: Path = AZURE) -> list[Point]:
    """Points chosen the way a user would: from the simulator's own sweep of the table."""
    table = inputs.load_table(table_path, 64)
    big = Config("paged", 32, 64.0)  # a pool that never binds at 32 rows
    workload = Workload(n, seed)
    cap, curve = _capacity(table, big, workload)
    small_cap, _ = _capacity(table, Config("paged", 32, 0.5), workload)
    peak = max(curve, key=lambda r: r["served_rate"])["rate"]
    past = [_round(1.25 * cap), _round(1.6 * cap), _round(2.2 * cap)]

    def poisson(rate: float) -> dict:
        return {"kind": "poisson", "rate": rate, "n": n, "seed": seed}

    points = [Point(f"rate-{r:g}", "below", poisson(r)) for r in (_round(0.4 * cap), _round(0.6 * cap),
                                                                   _round(0.8 * cap))]
    points.append(Point(f"rate-{_round(cap):g}", "near", poisson(_round(cap)), repeats=3))
    points += [Point(f"rate-{r:g}", "past", poisson(r), repeats=3 if i == 0 else 1) for i, r in enumerate(past)]
    points += [Point(f"small-pool-rate-{r:g}", "small-pool", poisson(r), pool_gib=0.5)
               for r in (_round(1.3 * small_cap), _round(2.0 * small_cap))]
    points.append(Point(f"padded-rate-{past[1]:g}", "backend", poisson(past[1]), backend="padded"))
    closed = [("closed-p256-8", {"kind": "closed-uniform", "prompt": "p256", "n": 8, "budget": 256}, 8, None),
              ("closed-p256-32", {"kind": "closed-uniform", "prompt": "p256", "n": 32, "budget": 256}, 32, None),
              ("closed-mixed-32", {"kind": "closed-mixed", "n": 32, "seed": seed}, 32, None),
              ("closed-mixed-64-through-8", {"kind": "closed-mixed", "n": 64, "seed": seed}, 8, None),
              ("closed-mixed-64-through-32-small-pool", {"kind": "closed-mixed", "n": 64, "seed": seed}, 32, 0.5)]
    points += [Point(i, "closed", t, max_batch=b, pool_gib=g, warmup=2, repeats=5, tokens=True) for i, t, b, g in closed]
    if azure.exists():
        points.append(_azure_point(table, azure, out, n, cap))
    plan = {"table": table["table_id"], "table_device": table["device"]["name"], "capacity_sim": cap,
            "small_pool_capacity_sim": small_cap, "peak_rate_sim": peak, "n": n, "seed": seed,
            "points": [asdict(p) for p in points], **provenance()}
    atomic_write_text(out / "plan.json", json.dumps(plan, indent=1) + "\n")
    return points


def _azure_point(table: dict, azure: Path, out: Path, n: int, cap: float) -> Point:
    """A window of the Azure conversation trace holding n requests, compressed in time to about the
    simulator's capacity for those very requests."""
    full, _ = import_azure(azure, ImportOptions())
    span = full.requests[n - 1].arrival + 1e-3  # the first n requests
    window, _ = import_azure(azure, ImportOptions(window=(0.0, span)))
    est, _ = _capacity(table, Config("paged", 32, 64.0), Workload(base=window))
    compress = _round(est / window.offered_rate)
    trace, _ = import_azure(azure, ImportOptions(window=(0.0, span), compress=compress))
    path = out / "traces" / "azure-conv-window.csv"
    write_trace(trace, path)
    return Point("azure-conv-window", "azure", {"kind": "file", "path": str(path.relative_to(out))})


# ---- the real runs (GPU) ----------------------------------------------------------------------------------
def run_dir(out: Path, p: Point, k: int) -> Path:
    return out / "real" / p.id / f"run-{k}"


def run_real(out: Path, expect_gpu: str | None = None, only: list[str] | None = None) -> None:
    """Every point (and repeat) on the engine; points with complete records are kept, not re-run."""
    from engine.engine import Engine, EngineConfig  # the GPU side only
    from tqdm import tqdm

    _, points = load_plan(out)
    points = [p for p in points if not only or p.id in only]
    todo = [(p, k) for p in points for k in range(1, p.repeats + 1) if not _complete(run_dir(out, p, k))]
    if not todo:
        print("every point already has its real records")
        return
    engine = Engine(EngineConfig(expect_gpu=expect_gpu))
    for p, k in tqdm(todo, desc="real runs", unit="run"):
        trace = build_trace(p.trace, out)
        pool = blocks_for_gib(p.pool_gib, engine.cfg.block_size) if p.pool_gib else None
        if k == 1:
            for _ in range(p.warmup):
                engine.run(trace, None, p.backend, tokens=False, pool_blocks=pool, max_batch=p.max_batch, progress=False)
        d = run_dir(out, p, k)
        if d.exists():  # an interrupted run: start the point again
            for f in d.iterdir():
                f.unlink()
        engine.run(trace, d, p.backend, tokens=p.tokens, pool_blocks=pool, max_batch=p.max_batch, progress=False,
                   extra_meta={"validation_point": p.id, "repeat": k, "warmup_runs": p.warmup})


def _complete(d: Path) -> bool:
    meta = d / "meta.json"
    return meta.exists() and json.loads(meta.read_text()).get("status") == "complete"


# ---- the report (CPU) -------------------------------------------------------------------------------------
@dataclass
class Compared:
    point: Point
    rate: float | None
    sim: dict
    real: list[dict] = field(default_factory=list)  # one per repeat

    @property
    def measured(self) -> dict:
        return {k: statistics.median(r[k] for r in self.real) for k in self.real[0] if _number(self.real[0][k])}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _error(pred: float, meas: float, key: str) -> float:
    """Relative error of the prediction; near-zero waits are judged against an absolute floor."""
    if not (math.isfinite(pred) and math.isfinite(meas)):
        return math.nan
    return (pred - meas) / max(abs(meas), ABS_FLOOR.get(key, 1e-9))


def compare(out: Path, table_path: Path | None) -> list[Compared]:
    table = inputs.load_table(table_path, 64)
    cost = CostModel(table)
    _, points = load_plan(out)
    results = []
    for p in points:
        runs = [read_run(run_dir(out, p, k)) for k in range(1, p.repeats + 1) if _complete(run_dir(out, p, k))]
        if not runs:
            continue
        trace = build_trace(p.trace, out)
        if runs[0].meta["trace_id"] != trace.trace_id:
            raise InputError(f"point {p.id}: the real run replayed trace {runs[0].meta['trace_id']}, "
                             f"the plan's is {trace.trace_id}")
        rate = trace.meta.get("rate") or trace.offered_rate
        cfg = SimConfig(p.backend, p.max_batch, runs[0].meta["pool_blocks"], runs[0].meta["block_size"])
        sim = simulate(trace, cost, cfg).record
        results.append(Compared(p, rate, _scored(sim, rate), [_scored(r, rate) for r in runs]))
    return results


def _scored(rec, rate) -> dict:
    s = summary(rec, rate)
    if rate is None:
        s.update(closed_run(rec))
    return s


def step_check(out: Path, table_path: Path | None) -> dict:
    """Measured step durations against the cost model at the same shapes, over every real run."""
    cost = CostModel(inputs.load_table(table_path, 64))
    ratios: dict[str, list[float]] = {"prefill": [], "decode paged": [], "decode padded": []}
    for d in sorted((out / "real").glob("*/run-*")):
        rec = read_run(d)
        s = rec.steps
        for row in s.itertuples():
            dur = row.end - row.start
            if row.kind == "prefill":
                ratios["prefill"].append(dur / cost.prefill(int(row.rows), int(row.padded_len)))
            else:
                pred = float(cost.decode(rec.meta["backend"], int(row.rows), int(row.kv_tokens), int(row.kv_max)))
                pred += cost.retire_s if row.retired else 0.0
                ratios[f"decode {rec.meta['backend']}"].append(dur / pred)
    return {k: {"n": len(v), "p10": float(np.percentile(v, 10)), "p50": float(np.median(v)),
                "p90": float(np.percentile(v, 90))} for k, v in ratios.items() if v}


def first_use(out: Path, table_path: Path | None) -> list[dict] | None:
    """The prefill steps of diagnostics/azure-first-use (the Azure window replayed twice in one engine, and once
    more in a fresh engine with expandable allocator segments) against the cost model: what a prefill shape the
    engine has not run before costs."""
    root = out / "diagnostics" / "azure-first-use"
    if not root.exists():
        return None
    cost = CostModel(inputs.load_table(table_path, 64))
    rows = []
    for d in sorted(p for p in root.iterdir() if (p / "meta.json").exists()):
        rec = read_run(d)
        p = rec.steps[rec.steps.kind == "prefill"]
        dur = (p.end - p.start).to_numpy()
        pred = np.array([cost.prefill(int(w), int(n)) for w, n in zip(p.rows, p.padded_len)])
        s = summary(rec)
        rows.append({"run": d.name, "prefills": len(p), "prefill_ms_p50": 1e3 * float(np.median(dur)),
                     "measured_over_model_p50": float(np.median(dur / pred)), "served_rate": s["served_rate"],
                     "tpot_p50": s["tpot_p50"]})
    return rows


def write_report(out: Path, table_path: Path | None) -> Path:
    import csv
    import io

    results = compare(out, table_path)
    if not results:
        raise InputError("no real records to compare yet; run `python -m sim validate real` on a GPU", path=out / "real")
    rows = []
    for c in results:
        m = c.measured
        row = {"point": c.point.id, "role": c.point.role, "backend": c.point.backend, "max_batch": c.point.max_batch,
               "pool_gib": c.point.pool_gib, "rate": c.rate, "repeats": len(c.real)}
        for k in FIGURES + (("wall_time_s",) if c.rate is None else ()):
            row[f"{k}_sim"], row[f"{k}_real"] = c.sim.get(k), m.get(k)
            row[f"{k}_err"] = _error(c.sim.get(k, math.nan), m.get(k, math.nan), k)
        if len(c.real) > 1:
            row["served_rate_spread"] = (max(r["served_rate"] for r in c.real) - min(r["served_rate"] for r in c.real)) \
                / m["served_rate"]
        if c.rate is not None:
            row["stable_sim"], row["stable_real"] = c.sim["stable"], all(r["stable"] for r in c.real)
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "points.csv", buf.getvalue())
    steps = step_check(out, table_path)
    table = inputs.load_table(table_path, 64)
    md = _markdown(results, rows, steps, out, table, first_use(out, table_path))
    atomic_write_text(out / "report.md", md)
    _plot(results, out / "validation.png")
    return out / "report.md"


def _curve(results: list[Compared], roles=("below", "near", "past")) -> list[Compared]:
    return sorted((c for c in results if c.point.role in roles), key=lambda c: c.rate)


def headline(results: list[Compared]) -> dict:
    """The issue's targets, measured: served-rate error, stable-point wait error, capacity bracket, sag, closed."""
    arrivals = [c for c in results if c.rate is not None]
    curve = _curve(results)
    served_err = max(abs(_error(c.sim["served_rate"], c.measured["served_rate"], "served_rate")) for c in arrivals)
    waits = [(c.point.id, c.sim["queue_wait_p50"], c.measured["queue_wait_p50"]) for c in arrivals
             if all(r["stable"] for r in c.real)]
    wait_ok = all(abs(p - m) <= max(0.10 * abs(m), 0.020) for _, p, m in waits)
    br_sim = capacity_bracket((c.rate, c.sim["stable"]) for c in curve)
    br_real = capacity_bracket((c.rate, all(r["stable"] for r in c.real)) for c in curve)

    def drop(vals: list[float]) -> float:
        return max(vals) - vals[-1]
    sag_sim = drop([c.sim["served_rate"] for c in curve])
    sag_real = drop([c.measured["served_rate"] for c in curve])
    closed = [c for c in results if c.point.role == "closed"]
    return {
        "served_rate_max_abs_err": served_err,
        "stable_wait_p50_within_max_10pct_20ms": wait_ok,
        "stable_wait_points": [(i, round(p, 4), round(m, 4)) for i, p, m in waits],
        "capacity_bracket_sim": br_sim, "capacity_bracket_real": br_real, "capacity_bracket_equal": br_sim == br_real,
        "sag_sim": sag_sim, "sag_real": sag_real,
        "sag_within_25pct": abs(sag_sim - sag_real) <= 0.25 * sag_real if sag_real > 0 else None,
        "closed_wall_max_abs_err": max((abs(_error(c.sim["wall_time_s"], c.measured["wall_time_s"], "wall")) for c in closed),
                                       default=math.nan),
        "ttft_p50_max_abs_err": max(abs(_error(c.sim["ttft_p50"], c.measured["ttft_p50"], "ttft_p50")) for c in results),
    }


def _fmt(v, spec=".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec) if _number(v) else str(v)


def _markdown(results: list[Compared], rows: list[dict], steps: dict, out: Path, table: dict,
              diag: list[dict] | None) -> str:
    h = headline(results)
    plan, _ = load_plan(out)
    first = read_run(next(iter(sorted((out / "real").glob("*/run-1")))))
    dev, sw = first.meta["device"], first.meta["software"]
    lines = ["# Validation: simulator against the real engine", "",
             f"Real runs on {dev['name']} ({dev.get('memory_gib')} GiB; torch {sw.get('torch')}, triton {sw.get('triton')}); "
             f"predictions from cost table {table['table_id']} ({table['device']['name']}); points chosen from the "
             f"sweep of table {plan['table']}. {len(results)} points, "
             f"{sum(len(c.real) for c in results)} real runs. Errors are (predicted - measured) / measured; "
             f"queue wait p50 errors use a {ABS_FLOOR['queue_wait_p50'] * 1e3:.0f} ms floor on the denominator.", "",
             "## Targets", "",
             f"- served rate error at every point: max {h['served_rate_max_abs_err']:.1%} (target <= 3%)",
             f"- queue wait p50 at stable points within max(10%, 20 ms): {_fmt(h['stable_wait_p50_within_max_10pct_20ms'])} "
             f"({', '.join(f'{i}: {p:.3f} vs {m:.3f} s' for i, p, m in h['stable_wait_points'])})",
             f"- capacity bracket: simulated {h['capacity_bracket_sim']}, measured {h['capacity_bracket_real']}: "
             f"{'equal' if h['capacity_bracket_equal'] else 'DIFFERENT'}",
             f"- sag past capacity (peak served rate minus served rate at the highest rate): simulated "
             f"{h['sag_sim']:.2f}, measured {h['sag_real']:.2f} req/s; within 25%: {_fmt(h['sag_within_25pct'])}",
             f"- closed controls wall time: max error {h['closed_wall_max_abs_err']:.1%} (target <= 5%); "
             f"TTFT p50 everywhere: max error {h['ttft_p50_max_abs_err']:.1%} (target <= 10%)", "",
             "## Points (predicted / measured, error)", ""]
    cols = ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95", "tpot_p50", "group_size_p50",
            "group_size_p95", "group_size_max", "padding_waste_p50", "padding_waste_p95")
    lines.append("| point | rate | " + " | ".join(cols) + " | stable sim/real | repeats (spread) |")
    lines.append("|" + "---|" * (len(cols) + 4))
    for r in rows:
        cells = [f"{_fmt(r[f'{k}_sim'])} / {_fmt(r[f'{k}_real'])} ({_fmt(r[f'{k}_err'], '+.0%')})" for k in cols]
        stable = f"{_fmt(r.get('stable_sim'))}/{_fmt(r.get('stable_real'))}" if "stable_sim" in r else "closed"
        spread = f"{r['repeats']} ({r['served_rate_spread']:.1%})" if "served_rate_spread" in r else str(r["repeats"])
        lines.append(f"| {r['point']} | {_fmt(r['rate'])} | " + " | ".join(cells) + f" | {stable} | {spread} |")
    lines += ["", "## Closed controls (median of the recorded runs after warm-up)", "",
              "| point | wall s sim / real (error) | TTFT p50 s sim / real (error) |", "|---|---|---|"]
    for r in rows:
        if r["role"] == "closed":
            lines.append(f"| {r['point']} | {_fmt(r['wall_time_s_sim'])} / {_fmt(r['wall_time_s_real'])} "
                         f"({_fmt(r['wall_time_s_err'], '+.1%')}) | {_fmt(r['ttft_p50_sim'])} / {_fmt(r['ttft_p50_real'])} "
                         f"({_fmt(r['ttft_p50_err'], '+.1%')}) |")
    lines += ["", "## Step costs: measured step durations over the cost model's prediction at the same shape", "",
              "| steps | n | p10 | p50 | p90 |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['p10']:.3f} | {v['p50']:.3f} | {v['p90']:.3f} |" for k, v in steps.items()]
    if diag:
        lines += ["", "## Diagnosis: prefill shapes the engine has not run before", "",
                  "The Azure window's prompts have arbitrary lengths, so nearly every admission group is a (width, "
                  "padded length) the engine meets for the first time. The same window replayed twice in one engine, "
                  "and once in a fresh engine with expandable allocator segments (diagnostics/azure-first-use/):", "",
                  "| run | prefills | prefill ms p50 | measured / model p50 | served req/s | TPOT p50 s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['run']} | {d['prefills']} | {d['prefill_ms_p50']:.1f} | {d['measured_over_model_p50']:.2f} | "
                  f"{d['served_rate']:.1f} | {d['tpot_p50']:.4f} |" for d in diag]
    lines += ["", "![validation](validation.png)", ""]
    return "\n".join(lines)


def _plot(results: list[Compared], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = _curve(results)
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    rates = [c.rate for c in curve]
    for key, a, label in (("served_rate", ax[0], "served rate (req/s)"), ("queue_wait_p50", ax[1], "queue wait p50 (s)")):
        real = [c.measured[key] for c in curve]
        spread = [[c.measured[key] - min(r[key] for r in c.real) for c in curve],
                  [max(r[key] for r in c.real) - c.measured[key] for c in curve]]
        a.errorbar(rates, real, yerr=spread, fmt="o-", label="real engine (H200)", capsize=3)
        a.plot(rates, [c.sim[key] for c in curve], "s--", label="simulator")
        a.set_xlabel("arrival rate (req/s)")
        a.set_ylabel(label)
        a.legend()
    ax[0].plot(rates, rates, ":", color="grey", label="served = offered")
    ax[0].set_title("Served rate: the sim tracks the engine through capacity and the sag")
    ax[1].set_yscale("symlog", linthresh=0.01)
    ax[1].set_title("Queue wait p50 against arrival rate")
    names = [c.point.id for c in results]
    errs = [_error(c.sim["served_rate"], c.measured["served_rate"], "served_rate") * 100 for c in results]
    ax[2].barh(names, errs, color=["tab:red" if abs(e) > 3 else "tab:green" for e in errs])
    ax[2].axvline(-3, ls=":", color="grey")
    ax[2].axvline(3, ls=":", color="grey")
    ax[2].set_xlabel("served-rate error (%)")
    ax[2].set_title("Every point: served-rate error (target within 3%)")
    ax[2].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
