"""A GPU instance's serving speed: a corrected table rescaled per kind by what a few serving runs on that GPU paid.

`python -m calibrate --from-runs RUN_DIR ... --table T --rescale --out T2` (no GPU), and `python -m calibrate
--refresh T --serving-probe --out T2` (a short serving run per prefill policy on this GPU, then the same).

Near capacity TTFT moves by tens of percent per percent of step speed, and GPUs of one name differ in serving speed
by about 1% (prefill more than decode). A closed refresh's readings did not follow that (README, validation v29:
across four H100s its decode reading correlated -0.29 with the GPU's serving speed, its prefill reading +0.41),
while a GPU's runs agree with each other on it: on one H100 each run's summed time over its price sat within about
0.3% (decode) and 0.7% (prefill) of the others', whatever the trace or policy. So the speed is read where it shows,
in serving: per kind (prefill, every step that computes prompt positions: prefill, chunk and fused steps; decode
per backend), the runs' summed step time over the price T gives those steps in their serving context, less what
the price holds that does not scale with the GPU's speed (retirement and a decode stretch's end: host work), the
1% of steps at either end of real / price left out (a rare stall), as a correction's class factor is. Steps are
priced at the correction's reference clock, as the simulator prices them: a GPU whose clock sags in serving is
that much slower.

With `--median-gpu` (runs from MEDIAN_GPUS or more GPUs), each kind's factor is the median over the GPUs of each
GPU's own, not the runs pooled: the speed of a typical GPU of the kind, for a GPU not yet seen. A correction pools
its runs' steps, so GPUs with more runs, or a few slow ones, move its level: on six H100s the prefill of two sat
2-3% slower than the four others (README, validation v32).

A table whose correction already spans SPANNED_GPUS or more GPUs is rescaled to one GPU's own runs with a warning:
so rescaled from a GPU's first two points, such a table predicted that GPU's other points no better than as it is
(README, validations v40-v42): a few points' speed tells the others' little better than the GPU-to-GPU spread does.

T's points are multiplied by the factors and refitted (servecap/calibrate/refresh.py's `rescaled`); its
serving-context correction, a set of ratios to that surface, is kept as it is. Every factor is applied (a
serving reading is what serving pays, prefill included), and the table records them, each run's own, and the runs.
"""
from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import numpy as np

from servecap.costs.context import PREFILL, Correction
from servecap.costs.recorded import host_price, scaled_price
from servecap.costs.table import save_cost_table
from servecap.traces.errors import InputError
from servecap.traces.provenance import git_commit, now_iso

from .from_runs import class_factor, gpu_key, table_and_runs
from .refresh import SPANNED_GPUS, refreshed_from, rescaled, spanned_gpus

MEDIAN_GPUS = 3  # a median over fewer is one GPU's reading or the mean of two


def speed_key(steps, backend: str) -> np.ndarray:
    """Each priced step's refresh kind: `prefill` for a step that computes prompt positions, else `decode BACKEND`."""
    return np.where(steps.step_kind.to_numpy() == "decode", f"decode {backend}", PREFILL)


def _parts(steps, correction: Correction | None) -> tuple[np.ndarray, np.ndarray]:
    """(time the GPU's speed scales, its price) per step: the real time less retirement and the stretch end, and the
    contextual price at the reference clock less the same."""
    at_ref = steps.assign(clock_mhz=np.nan)
    return at_ref.real_s.to_numpy() - host_price(at_ref, correction), scaled_price(at_ref, correction)


def speed_factors(runs: dict[Path, dict], correction: Correction | None, median_gpu: bool = False) -> dict:
    """{"factors": {kind: factor}, "steps": {kind: n}, "runs": {run: {kind: factor}}} over `runs` (load_runs').
    `median_gpu`: each kind's factor is the median over the runs' GPUs of each GPU's own (its runs pooled), given
    too ({"gpus": {uuid: {kind: factor}}}), where pooled it is the runs' (module docstring)."""
    parts = {path: (speed_key(r["steps"], r["meta"]["backend"]), *_parts(r["steps"], correction))
             for path, r in runs.items()}

    def pooled(paths) -> tuple[np.ndarray, dict[str, float]]:
        k, real, price = (np.concatenate(x) for x in zip(*(parts[p] for p in paths)))
        return k, {kind: class_factor(real[k == kind], price[k == kind]) for kind in sorted(np.unique(k))}

    k, factors = pooled(runs)
    out = {"factors": factors, "steps": {kind: int((k == kind).sum()) for kind in factors},
           "runs": {str(path): pooled([path])[1] for path in runs}}
    if median_gpu:
        by_gpu: dict[str, list[Path]] = {}
        for path, r in runs.items():
            try:
                by_gpu.setdefault(gpu_key(r["meta"], "--median-gpu"), []).append(path)
            except InputError as e:
                raise InputError(str(e), path=path) from None
        if len(by_gpu) < MEDIAN_GPUS:
            raise InputError(f"--median-gpu takes the median over {MEDIAN_GPUS} or more GPUs; these runs are from "
                             f"{len(by_gpu)}")
        out["gpus"] = {g: pooled(paths)[1] for g, paths in sorted(by_gpu.items())}
        out["factors"] = {kind: float(np.median([f[kind] for f in out["gpus"].values() if kind in f]))
                          for kind in factors}
    return out


def rescale_from_runs(paths: list[Path], table_path: Path, out: Path, argv: list[str], force: bool = False,
                      extra: dict | None = None, median_gpu: bool = False) -> tuple[str, dict]:
    """Write `table_path` rescaled per kind by the speed of the runs under `paths` to `out`; return its id and the
    measurement (speed_factors', `median_gpu` as there). `extra` joins the table's `refresh` record (a serving
    probe's own details)."""
    table, runs = table_and_runs(paths, table_path, out, force)
    if not any(len(r["steps"]) for r in runs.values()):
        raise InputError("no step of these runs could be priced (no decode step, no prefill step of a known shape)")
    measured = speed_factors(runs, Correction(table.correction) if table.correction else None, median_gpu)
    factors = measured["factors"]
    raw = rescaled({k: v for k, v in table.raw.items() if k != "table_id"}, factors)
    gpus = sorted({u for r in runs.values() if (u := (r["meta"].get("device") or {}).get("uuid"))})
    if len(gpus) == 1:  # the table now prices that GPU, as a refresh on it would
        raw["device"] = next(r["meta"]["device"] for r in runs.values())
        spanned = spanned_gpus(table)
        if spanned >= SPANNED_GPUS and "probe" not in (extra or {}):  # a probe's refresh has warned already
            warnings.warn(f"{table_path}'s correction already prices serving on {spanned} GPUs of its kind; rescaled "
                          "to one GPU's own runs, such a table predicted that GPU's other runs no better than as it "
                          "is (README, validations v40-v42): plan with both", stacklevel=2)
    raw.update(name=f"{table.raw.get('name', table.table_id)} (rescaled to the serving speed of {len(runs)} run(s))",
               created_at=now_iso(), git_commit=git_commit(),
               refreshed_from=refreshed_from(table),
               refresh={"method": "serving speed: summed step time over the table's price in context, per kind" +
                                  (", the median over the runs' GPUs of each GPU's own" if median_gpu else "") +
                                  " (servecap/calibrate/speed.py)",
                        "factors": factors, "applied": factors, "steps": measured["steps"],
                        **({"per_gpu": measured["gpus"]} if median_gpu else {}),
                        "per_run": measured["runs"], "gpus": gpus, **(extra or {}),
                        "command": shlex.join(["python", "-m", "calibrate", *argv])})
    return save_cost_table(raw, out), measured


def describe(measured: dict) -> str:
    """The measurement as text: each kind's factor and steps, and the spread of the runs' own factors."""
    lines = ["serving speed, summed real / price in context (1% trimmed):"]
    for kind, f in measured["factors"].items():
        own = [r[kind] for r in measured["runs"].values() if kind in r]
        spread = f", runs {min(own):.4f}-{max(own):.4f}" if len(own) > 1 else ""
        lines.append(f"  {kind:14s} {f:.4f} over {measured['steps'][kind]} steps of {len(own)} run(s){spread}")
    for kind in measured["factors"] if "gpus" in measured else ():
        each = sorted(g[kind] for g in measured["gpus"].values() if kind in g)
        lines.append(f"  {kind:14s} the median of {len(each)} GPUs' own: " + ", ".join(f"{x:.4f}" for x in each))
    return "\n".join(lines)


def serving_probe(table_path: Path, out: Path, cfg, policies: list[str], backend: str, argv: list[str], n: int,
                  telemetry=None, traces: dict[str, Path] | None = None) -> int:
    """Serve n requests near capacity with each policy on this GPU (servecap/calibrate/serving.py, PROBE_LOADS;
    records in OUT.runs/): the calibration serving phase's synthetic trace, or the first n of each of `traces`
    (name -> trace file: traffic like the one planned for, its own window); then write `table_path` rescaled to
    their speed to `out`."""
    import time

    from tqdm import tqdm

    from servecap.engine.engine import Engine
    from servecap.traces.trace_io import read_trace

    from .serving import PROBE_LOADS, serve_runs, serving_runs

    t0 = time.perf_counter()
    given = {name: read_trace(path) for name, path in (traces or {}).items()}  # a bad file refused before the engine
    engine = Engine(cfg)
    runs = serving_runs(table_path, policies, backend, cfg, n, PROBE_LOADS, given or None)
    folder = out.with_name(out.name + ".runs")
    with tqdm(total=len(runs), unit="run", desc="serving probe", dynamic_ncols=True) as bar:
        dirs = serve_runs(engine, runs, folder, backend, lambda run: (bar.set_postfix_str(run.name, refresh=False),
                                                                     bar.update()))
    probe = {"probe": {"runs": str(folder), "requests": n, "loads": dict(PROBE_LOADS), "policies": policies,
                       "traces": {name: {"path": str(path), "trace_id": given[name].trace_id}
                                  for name, path in (traces or {}).items()} or "synthetic (the serving phase's)",
                       "wall_s": round(time.perf_counter() - t0, 1),
                       **({"telemetry": telemetry.summary()} if telemetry is not None else {})}}
    tid, measured = rescale_from_runs(dirs, table_path, out, argv, force=True, extra=probe)
    print(describe(measured))
    print(f"wrote cost table {tid} to {out} (rescaled from {table_path} by a serving probe of {len(dirs)} runs in "
          f"{folder}, {time.perf_counter() - t0:.0f} s)")
    return 0
