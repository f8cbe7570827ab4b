"""The validation plan: which real runs grade the simulator, chosen from the simulator's own sweeps of a frozen
cost table, with every point's prediction written down before any of them runs.

The protocol (README, "Validation is blind"): the table's id and creation time go into the plan; the predictions
are made here, from that table, before the engine runs a single point; the report refuses real runs made before
the table existed or planned against another table. A plan is never overwritten unless asked (--force), and a
group of points is never left out without the plan saying so.

Points: the seeded curve (below, near and past capacity), a small pool, closed controls; public traces with
arbitrary lengths (an Azure conversation window and a ShareGPT-lengths Poisson trace, each below, near and past
capacity; ShareGPT near since validation v20), each on the first pass of a freshly started engine; each prefill
policy besides padded (a closed control, three rates, the Azure window); and the sag candidates of a sag search,
when given.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from servecap.costs.model import CostModel
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.sim import inputs
from servecap.sim.fleet import simulate_fleet
from servecap.sim.simulator import SimConfig, simulate
from servecap.sim.sweep import Workload, run_sweep
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.importers import ImportOptions, import_azure, import_lengths
from servecap.traces.metrics import scored, summary, token_gaps
from servecap.traces.provenance import provenance
from servecap.traces.trace_io import write_trace
from servecap.traces.workload import Trace, at_rate, poisson_trace

from . import mechanisms
from .points import Point, build_trace, load_plan, round_rate as _round, select

ENGINE_START_S = 40.0  # for the time estimate only
# The public traces' points are cut to what the engine serves by default (servecap/engine/cli.py: prompts to 4096 tokens,
# budgets to 256), as every import did before imports kept full lengths: the same rows as the plans made then.
PUBLIC_CAPS = ImportOptions(max_prompt=4096, max_budget=256)
# The configuration whose capacity places the points: 64 GiB stands for the engine's own (large) pool.
LARGE_POOL = ServingConfig(pool=PoolSize(gib=64.0))


def capacity(table, config: ServingConfig, workload: Workload) -> float:
    """The simulator's highest stable rate for `config`, from a fine sweep around its saturated estimate."""
    res, _ = run_sweep(table, [config], None, workload, progress=False, jobs=1)
    rough = res[0].bracket[0] or res[0].estimate
    fine, _ = run_sweep(table, [config], list(np.round(np.geomspace(0.5 * rough, 2.5 * rough, 24), 2)), workload,
                        progress=False, jobs=1)
    lo, _ = fine[0].bracket
    return lo or fine[0].rates[0]


def point_config(p: Point) -> SimConfig:
    """The simulator's configuration of point p (a pool that never binds stands for the engine's own large pool)."""
    return SimConfig(p.serving, detail="tokens" if p.tokens else "steps")


def point_simulation(p: Point, root: Path):
    """Point p's trace, its rate and run(trace, cost): one simulated run of the point's configuration, scored as its
    prediction is (servecap/sim/intervals.py simulated)."""
    from servecap.sim.intervals import simulated
    trace = build_trace(p.trace, root)
    rate = trace.meta.get("rate") or trace.offered_rate
    return trace, rate, simulated(point_config(p), rate)


def point_band(iv, table, p: Point, root: Path) -> dict:
    """Point p's prediction interval (servecap/sim/intervals.py) on the one trace its real runs replay: what the band is
    graded against is that trace's outcome, so other seeds' traces are not among its samples. Its runs on every core
    (a plan is made on the GPU's host, in its session's time)."""
    trace, _, run = point_simulation(p, root)
    return iv.band([trace], run, jobs=os.cpu_count() or 1)


def predict(table, p: Point, root: Path) -> dict:
    """The simulator's summary of point p, with the closed-run figures and, where every token's time is kept, the
    largest gap between an incumbent's tokens."""
    trace = build_trace(p.trace, root)
    cfg = point_config(p)
    if p.serving.replicas > 1:
        rec = simulate_fleet(trace, CostModel(table), cfg).record
    else:
        rec = simulate(trace, CostModel(table), cfg).record
    rate = trace.meta.get("rate") or trace.offered_rate
    s = scored(rec, rate)
    if p.tokens:
        s["gap_max"] = token_gaps(rec)["gap_max"]
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in s.items()}


def make_plan(table_path: Path | None, out: Path, *, n: int = 400, seed: int = 0, azure: Path | None = None,
              sharegpt: Path | None = None, skip: tuple[str, ...] = (), sag: Path | None = None,
              predictions: Path | None = None, force: bool = False, allow_nonstationary: bool = False,
              interval: float | None = None, apart: bool = False, public_policies: tuple[str, ...] = ("padded",),
              repeats: int | None = None, mechanisms: tuple[str, ...] = (),
              cache_traces: dict[str, Path] | None = None,
              max_num_batched_tokens: int | None = None, points_from: Path | None = None,
              only: list[str] | None = None, azure_from_s: float = 0.0) -> list[Point]:
    """Points chosen the way a user would: from the simulator's own sweep of the table. The public traces are
    planned for each of `public_policies`. `repeats` K: K fresh runs at every near- and past-capacity point,
    public and mechanism (the engine's own run-to-run spread is measured there); None: one at the public points,
    the mechanisms' own counts (servecap/validate/mechanisms.py). `mechanisms` adds servecap/validate/mechanisms.py's groups (the
    prefix cache's on the trace files of `cache_traces`, by name). `max_num_batched_tokens`: every point's per-step
    token cap, its capacity searches' too (a full-length trace's long prompts beside 32 rows). `points_from`: an
    earlier plan's directory, whose points are predicted as they are instead (_points_from). `only`: keep these of the
    chosen points, by id or by id without its rate (the plan names the others it left out). `azure_from_s`: the
    Azure points' window starts this far into the trace (another window, other traffic). `apart`: the `interval`
    bands draw decode's and the prompt steps' costs apart (servecap/sim/intervals.py)."""
    out = Path(out)
    if (out / "plan.json").exists() and not force:
        raise InputError("already holds a validation plan; its real runs were graded against it. Choose another "
                         "--out, or pass --force to replace it", path=out / "plan.json")
    table = inputs.load_table(table_path, allow_nonstationary=allow_nonstationary)
    source = None
    if points_from is not None:
        points, source = _points_from(Path(points_from), out)
        cap = small_cap = None
        blind: dict = {}
    else:
        points, cap, small_cap, blind = _chosen_points(table, out, n, seed, azure, sharegpt, skip, sag, predictions,
                                                       public_policies, repeats, mechanisms, cache_traces,
                                                       max_num_batched_tokens, azure_from_s)
    left_out = []
    if only is not None:
        points, left_out = select(points, only)
    predicted = {p.id: predict(table, p, out) for p in points}
    intervals = None
    if interval is not None:  # frozen with the predictions, before any real run
        from servecap.sim.intervals import Intervals
        iv = Intervals(table, interval, apart=apart)
        intervals = {**iv.describe(), "bands": {p.id: point_band(iv, table, p, out) for p in points}}
    estimate = _estimate_s(points, predicted)
    plan = {"table": {"id": table.table_id, "created_at": table.created_at, "device": table.device_name,
                      "gpu_uuid": table.gpu_uuid, "path": str(table.path), "stationarity": table.stationarity and
                      {k: table.stationarity[k] for k in ("passed", "limit", "prefill", "decode")}},
            "planned_at": time.time(), "capacity_sim": cap, "small_pool_capacity_sim": small_cap, "n": n, "seed": seed,
            "skipped": list(skip), **({"left_out": left_out} if only is not None else {}), "estimated_gpu_s": estimate,
            "points": [p.to_json() for p in points], "predictions": predicted, "blind": blind,
            **({"intervals": intervals} if intervals else {}), **({"points_from": source} if source else {}),
            **provenance()}
    atomic_write_text(out / "plan.json", json.dumps(plan, indent=1, default=float) + "\n")
    return points


def _chosen_points(table, out: Path, n: int, seed: int, azure: Path | None, sharegpt: Path | None,
                   skip: tuple[str, ...], sag: Path | None, predictions: Path | None, public_policies: tuple[str, ...],
                   repeats: int | None, mechanisms: tuple[str, ...], cache_traces: dict[str, Path] | None,
                   max_num_batched_tokens: int | None,
                   azure_from_s: float) -> tuple[list[Point], float | None, float | None, dict]:
    """make_plan's points, chosen from the table's own sweeps: (points, capacity, small-pool capacity, blind)."""
    memory_or_mixed = {"on-demand", "mixed"} & set(mechanisms)
    for group, path in (("public", azure), ("public", sharegpt)):
        if (group not in skip or memory_or_mixed) and path is None:
            raise InputError("the public-trace points need --azure PATH and --sharegpt PATH (the Azure conversation "
                             "trace and the ShareGPT lengths CSV); pass --skip public to plan without them, which "
                             "the plan records (the on-demand and mixed points need them too)")
        if path is not None and not Path(path).is_file():
            raise InputError("not found", path=path)
    if "prefix-cache" in mechanisms and not cache_traces:
        raise InputError("the prefix-cache points need trace files with prefix hashes: --cache-trace NAME=PATH "
                         "(e.g. Mooncake's, imported with `traces import-mooncake`)")
    for path in (cache_traces or {}).values():
        if not Path(path).is_file():
            raise InputError("not found", path=path)
    if "policies" not in skip and predictions is None:
        raise InputError("the prefill-policy points are the blind predictions' (python -m validate predict): give "
                         "their directory with --predictions DIR, or pass --skip policies, which the plan records")
    workload = Workload(n, seed)
    cap = small_cap = None

    def capped(config: ServingConfig) -> ServingConfig:
        return config.but(max_num_batched_tokens=max_num_batched_tokens)

    def search(config: ServingConfig, w: Workload) -> float:
        return capacity(table, capped(config), w)

    def poisson(rate: float) -> dict:
        return {"kind": "poisson", "rate": rate, "n": n, "seed": seed}

    points = []
    if "curve" not in skip:
        cap = search(LARGE_POOL, workload)
        small_cap = search(LARGE_POOL.but(pool=PoolSize(gib=0.5)), workload)
        points += [Point(f"rate-{_round(f * cap):g}", role, poisson(_round(f * cap)), repeats=2 if role == "near" else 1)
                   for f, role in ((0.5, "below"), (0.8, "below"), (1.0, "near"), (1.3, "past"), (2.0, "past"))]
        points.append(Point(f"small-pool-rate-{_round(1.5 * small_cap):g}", "small-pool",
                            poisson(_round(1.5 * small_cap)), ServingConfig(pool=PoolSize(gib=0.5))))
    closed = {"closed-p256-32": ({"kind": "closed-uniform", "prompt": "p256", "n": 32, "budget": 256}, 32),
              "closed-mixed-32": ({"kind": "closed-mixed", "n": 32, "seed": seed}, 32),
              "closed-mixed-64-through-8": ({"kind": "closed-mixed", "n": 64, "seed": seed}, 8)}
    if "closed" not in skip:
        points += [Point(i, "closed", t, ServingConfig(max_batch=b), warmup=2, repeats=3, tokens=True)
                   for i, (t, b) in closed.items()]
    traces_dir = out / "traces"
    window = lengths = None
    if azure is not None:
        window = _azure_window(azure, n, azure_from_s)
    if sharegpt is not None:
        lengths, _ = import_lengths(sharegpt, "num_prefill_tokens", "num_decode_tokens", rate=1.0, n=n, seed=seed,
                                    max_prompt=PUBLIC_CAPS.max_prompt, max_budget=PUBLIC_CAPS.max_budget)
    if "public" not in skip:
        for policy in public_policies:
            tag = "" if policy == "padded" else policy.replace(":", "") + "-"
            for base, name, loads in ((window, "azure-conv", ((0.6, "below"), (1.0, "near"), (1.5, "past"))),
                                      (lengths, "sharegpt", ((0.7, "below"), (1.0, "near"), (1.3, "past")))):
                bcap = search(LARGE_POOL.but(prefill=policy), Workload(base=base))
                for f, role in loads:
                    if role != "below" or "public-below" not in skip:
                        points.append(_scaled(base, f * bcap, f"{tag}{name}-{role}", traces_dir, "public",
                                              ServingConfig(prefill=policy), 1 if role == "below" else repeats or 1))
    blind = {}
    if "policies" not in skip:
        added, blind = _blind_points(Path(predictions), traces_dir)
        points += added
    if mechanisms:
        points += _mechanism_points(search, mechanisms, poisson, workload, window, lengths, cache_traces, traces_dir,
                                    seed, repeats)
    if sag is not None:
        points += _sag_points(sag)
    if "fleet" not in skip:
        points += fleet_points(table, n, seed, capped(ServingConfig()))
    for p in points:
        p.serving = capped(p.serving)
    return points, cap, small_cap, blind


def _points_from(source: Path, out: Path) -> tuple[list[Point], dict]:
    """An earlier plan's points as they are, their trace files copied beside this plan: the same real runs then
    grade both plans' predictions (servecap/validate/comparison.py accepts runs made under the earlier one)."""
    if source.resolve() == out.resolve():
        raise InputError("--points-from names the plan's own directory", path=source)
    plan, points = load_plan(source)
    for p in points:
        if p.trace["kind"] == "file":
            dst = out / p.trace["path"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / p.trace["path"], dst)
    return points, {"dir": str(source), "table_id": plan["table"]["id"], "created_at": plan.get("created_at")}


def _mechanism_points(search: Callable[[ServingConfig, Workload], float], groups: tuple[str, ...], poisson,
                      workload: Workload, window: Trace | None,
                      lengths: Trace | None, cache_traces: dict[str, Path] | None, traces_dir: Path,
                      seed: int, repeats: int | None) -> list[Point]:
    from servecap.traces.trace_io import read_trace
    k = mechanisms.Repeats(repeats, repeats, True) if repeats else mechanisms.Repeats()

    def scaled(base: Trace, rate: float, name: str, role: str, serving: ServingConfig, n: int = 1,
               fresh: bool = False) -> Point:
        return _scaled(base, rate, name, traces_dir, role, serving, n, fresh)

    points = []
    if "on-demand" in groups:
        points += mechanisms.on_demand_points(search, poisson, workload, window, scaled, k)
    if "mixed" in groups:
        points += mechanisms.mixed_points(search, poisson, workload, window, lengths, scaled, seed, k)
    if "prefix-cache" in groups:
        points += mechanisms.prefix_cache_points(search, {name: read_trace(p) for name, p in cache_traces.items()},
                                                 scaled, k)
    return points


def _estimate_s(points: list[Point], predictions: dict) -> float:
    """GPU seconds the plan's real runs take, by the simulator's own wall times, plus an engine start per fresh
    point (a closed control's wall time is its whole run)."""
    runs = sum((p.warmup + p.repeats) * (predictions[p.id]["wall_time_s"] or 0) for p in points)
    return runs + ENGINE_START_S * max(1, sum(p.fresh for p in points))


def _azure_window(azure: Path, n: int, start_s: float = 0.0) -> Trace:
    """The first n requests the validation serves of the Azure conversation trace from `start_s` seconds into it
    (its own time; the points scale it): another window is other traffic of the same service."""
    whole, _ = import_azure(azure, ImportOptions())  # every row, on the file's own clock, which windows are cut on
    fits = [r.arrival for r in whole.requests if r.arrival >= start_s and r.prompt_tokens <= PUBLIC_CAPS.max_prompt]
    if len(fits) < n:
        raise InputError(f"the Azure trace holds {len(fits)} requests the validation serves from {start_s:g} s on, "
                         f"fewer than the {n} a point needs", path=azure)
    window, _ = import_azure(azure, replace(PUBLIC_CAPS, window=(start_s, fits[n - 1] + 1e-3)))
    return window


def _scaled(base: Trace, rate: float, name: str, traces_dir: Path, role: str,
            serving: ServingConfig = ServingConfig(), repeats: int = 1, fresh: bool = False) -> Point:
    """A point on `base` scaled to `rate`, its trace file written beside the plan (a public point, or any where
    `fresh`, runs on a freshly started engine: the first pass of its trace)."""
    rate = _round(rate)
    trace = at_rate(base, rate)
    path = traces_dir / f"{name}.csv"
    write_trace(trace, path)
    return Point(f"{name}-{rate:g}", role, {"kind": "file", "path": str(path.relative_to(traces_dir.parent))},
                 serving, fresh=fresh or role == "public", repeats=repeats)


FLEET = dict(replicas=2, n_factor=2, routers=("round-robin", "least-outstanding", "least-tokens"),
             differ=(("bimodal", "lattice"), ("loguniform", "uniform"), ("five", "lattice")))


def _fleet_rates(table, cfg: SimConfig, trace_of) -> float:
    """The fleet's highest stable rate in the simulator, from its saturated estimate and a scan around it."""
    from servecap.sim.inputs import closed
    from servecap.traces.metrics import served_rate
    cost = CostModel(table)
    est = served_rate(simulate_fleet(closed(trace_of(1.0)), cost, cfg).record)
    stable = [r for r in np.round(np.geomspace(0.5 * est, 1.5 * est, 16), 2)
              if summary(simulate_fleet(trace_of(r), cost, cfg).record, r)["stable"]]
    return float(max(stable, default=0.5 * est))


def fleet_points(table, n: int, seed: int, base: ServingConfig = ServingConfig()) -> list[Point]:
    """Two replicas: the seeded workload at three fleet rates (below, near, past the fleet's capacity) under two
    routers, and the workload and rate, of a few, where the simulated routers differ most in TTFT p95, under the
    best and the worst router there."""
    from servecap.traces.workload import synthetic_trace

    k, nf = FLEET["replicas"], n * FLEET["n_factor"]
    fleet = base.but(replicas=k)
    cfg = SimConfig(fleet)
    cap = _fleet_rates(table, cfg, lambda r: poisson_trace(r, nf, seed))
    points = [Point(f"fleet-{router}-rate-{_round(f * cap):g}", "fleet",
                    {"kind": "poisson", "rate": _round(f * cap), "n": nf, "seed": seed}, fleet.but(router=router))
              for router in FLEET["routers"][:2] for f in (0.6, 1.0, 1.5)]
    best = None
    cost = CostModel(table)
    for prompts, budgets in FLEET["differ"]:
        wcap = _fleet_rates(table, cfg, lambda r: synthetic_trace(r, nf, seed, prompts, budgets))
        for f in (0.8, 1.0, 1.2):
            rate = _round(f * wcap)
            trace = synthetic_trace(rate, nf, seed, prompts, budgets)
            p95 = {r: summary(simulate_fleet(trace, cost, SimConfig(fleet.but(router=r))).record, rate)["ttft_p95"]
                   for r in FLEET["routers"]}
            spread = max(p95.values()) / max(min(p95.values()), 1e-3)
            if best is None or spread > best[0]:
                best = (spread, prompts, budgets, rate, min(p95, key=p95.get), max(p95, key=p95.get))
    _, prompts, budgets, rate, good, bad = best
    points += [Point(f"fleet-differ-{router}-{prompts}-{budgets}-rate-{rate:g}", "fleet",
                     {"kind": "synthetic", "rate": rate, "n": nf, "seed": seed, "prompts": prompts, "budgets": budgets},
                     fleet.but(router=router)) for router in (good, bad)]
    return points


def _blind_points(root: Path, traces_dir: Path) -> tuple[list[Point], dict]:
    """The points the blind predictions were made for (their trace files copied beside the plan's), and those
    predictions with the table and commit they came from."""
    try:
        doc = json.loads((root / "predictions.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read the blind predictions ({e})", path=root / "predictions.json") from None
    points = []
    for d in doc["points"]:
        p = Point.from_json(d)
        if p.trace["kind"] == "file":
            src = root / p.trace["path"]
            dst = traces_dir / Path(p.trace["path"]).name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            p.trace = {"kind": "file", "path": str(dst.relative_to(traces_dir.parent))}
        points.append(p)
    blind = {"table": doc["table"], "git_commit": doc.get("git_commit"), "predicted_at": doc["predicted_at"],
             "predictions": doc["predictions"]}
    return points, blind


def _sag_points(path: Path) -> list[Point]:
    """The sag search's candidates (results/sag/candidates.json): each a configuration and its rates."""
    try:
        cands = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read the sag candidates ({e})", path=path) from None
    points = []
    for c in cands:
        for rate in c["rates"]:
            points.append(Point(f"sag-{c['name']}-rate-{rate:g}", "sag", {**c["trace"], "rate": rate},
                                ServingConfig(max_batch=c["max_batch"], pool=PoolSize(gib=c.get("pool_gib")),
                                              prefill=c.get("prefill", "padded"))))
    return points
