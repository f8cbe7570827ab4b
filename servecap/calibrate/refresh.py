"""A cost table refreshed for this GPU: its level re-measured here, its points rescaled by what changed.

Two GPUs of the same name differ a little (clocks, memory, the host). A whole calibration takes minutes; a refresh
measures the ratio of real step time to the table's price per kind (prefill; decode per backend), rescales the
table's points by it, refits, and writes a table that names the one it was refreshed from, the ratios and this GPU.
Two ways to measure (`by`):
- shapes: a handful of decode and prefill shapes in closed runs, each kind's median ratio to the table's model;
- serving: a seeded arrival trace per prefill policy near the capacity the table predicts for it (the calibration's
  serving-phase workload on seeds of its own), every served step over its typical price in context (a correction's
  class median), each kind's median over the steps of all the runs. Serving steps pay a context that closed runs do
  not (the step before, host work, the clock under load), and how much differs from GPU to GPU, which a closed
  refresh cannot see. The table keeps the refresh's own error for the prediction intervals
  (servecap/sim/intervals.py): what its runs' summed step time is still off from their summed price after the
  refresh (the mean of the log over the runs), and that mean's standard error, in quadrature.
"""
from __future__ import annotations

import json
import math
import shlex
import time
import warnings
from pathlib import Path

import numpy as np

from servecap.core.config import ServingConfig
from servecap.costs.fit import fit
from servecap.costs.model import CostModel, ExtrapolationWarning
from servecap.costs.table import CostTable, load_cost_table, save_cost_table
from servecap.traces.errors import InputError

from .plan import Run
from .points import prefill_steps, usable_steps

BY = ("shapes", "serving")
SERVING_LOADS = (("near", 0.9),)  # each policy once, near capacity: where a table's level matters most
SERVING_SEED = 9501  # neither the calibration's serving phase (9001 on) nor any validation plans it
DECODE_ROWS, DECODE_LENGTHS = (1, 8, 16, 32), (256, 2048)
REFRESH_BUDGET = 64  # tokens a decode run generates: 63 decode steps
PREFILL_SHAPES = ((1, 256), (8, 1024), (32, 256), (4, 4096))


def refresh_runs(backends: tuple[str, ...], max_batch: int) -> list[Run]:
    runs = [Run("prefill", (n,) * w, 1, ServingConfig(backend=backends[0]), reps=3, warmup=1, label=f"refresh prefill {w} x {n}")
            for w, n in PREFILL_SHAPES if w <= max_batch]
    runs += [Run("decode", (n,) * r, REFRESH_BUDGET, ServingConfig(backend=b), label=f"refresh decode {b} {r} x {n}")
             for b in backends for r in DECODE_ROWS if r <= max_batch for n in DECODE_LENGTHS]
    return runs


def ratios(cost: CostModel, runs: list[Run], samples: list[dict]) -> dict[str, list[float]]:
    """Measured over the table's model, per kind, for every re-measured point."""
    out: dict[str, list[float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        for run, s in zip(runs, samples):
            if run.kind == "prefill":
                for shape, d in prefill_steps(run, s).items():
                    out.setdefault("prefill", []).append(float(np.median(d)) / cost.prefill(shape))
            else:
                kv_tokens, kv_max, dur = usable_steps(s)
                pred = cost.decode(run.backend, run.width, kv_tokens, kv_max)
                out.setdefault(f"decode {run.backend}", []).append(float(np.median(dur / pred)))
    return out


def serving_ratios(engine, source: Path, cost: CostModel, backends: tuple[str, ...], policies: list[str],
                   folder: Path, n: int) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Serve the refresh's traces (module docstring) into folder/BACKEND/RUN; return every step's real time over its
    typical price in context per kind, pooled over the runs, and per run and kind its step count, median ratio,
    summed real time and summed price. A complete record already there (an interrupted refresh) is kept if this
    GPU made it."""
    from servecap.costs.recorded import contextual, priced_steps
    from servecap.traces.records import read_run
    from servecap.traces.telemetry import read_telemetry

    from .serving import serve_runs, serving_runs

    gpu = engine.metadata()["device"].get("uuid")
    pooled: dict[str, list[float]] = {}
    runs: dict[str, dict] = {}
    for b in backends:
        planned = serving_runs(source, policies, b, engine.cfg, n, SERVING_LOADS, SERVING_SEED)
        for r in planned:
            meta = folder / b / r.name / "meta.json"
            theirs = json.loads(meta.read_text()).get("device", {}).get("uuid") if meta.exists() else gpu
            if theirs != gpu:
                raise InputError(f"holds a refresh run made on GPU {theirs}, not this one ({gpu}): move it away or "
                                 f"refresh into another --out", path=meta.parent)
        for d in serve_runs(engine, planned, folder / b, b):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExtrapolationWarning)
                steps = priced_steps(read_run(d), cost, read_telemetry(d))
            kind = np.where(steps.step_kind == "decode", f"decode {b}", "prefill")
            real = steps.real_s.to_numpy()
            typical = contextual(steps, cost.correction, typical=True)
            summed = contextual(steps, cost.correction)
            runs[f"{b}/{d.name}"] = {}
            for k in sorted(set(kind)):
                m = kind == k
                ratio = real[m] / typical[m]
                pooled.setdefault(k, []).extend(ratio.tolist())
                runs[f"{b}/{d.name}"][k] = {"n": int(m.sum()), "median": float(np.median(ratio)),
                                            "real_s": float(real[m].sum()), "price_s": float(summed[m].sum())}
    return pooled, runs


def refresh_error(runs: dict[str, dict], factor: dict[str, float]) -> dict:
    """The serving refresh's own error in a run's speed (module docstring): each run's log of summed real time over
    its summed price after the refresh; their mean, its standard error, and the two in quadrature (None with fewer
    than two runs)."""
    logs = [math.log(sum(v["real_s"] for v in r.values()) / sum(v["price_s"] * factor[k] for k, v in r.items()))
            for r in runs.values()]
    if len(logs) < 2:
        return {"runs": len(logs), "sigma": None}
    mean, se = float(np.mean(logs)), float(np.std(logs, ddof=1) / math.sqrt(len(logs)))
    return {"runs": len(logs), "mean_log": mean, "standard_error": se, "sigma": math.hypot(mean, se),
            "log_levels": dict(zip(runs, logs))}


def rescaled(raw: dict, factor: dict[str, float]) -> dict:
    """The table's points with each kind's times multiplied by its factor, refitted."""
    def scale(p: dict, f: float) -> dict:
        return {**p, **{k: p[k] * f for k in ("median_s", "p10_s", "p90_s")}}
    prefill = [scale(p, factor["prefill"]) for p in CostTable(raw).prefill_points()]  # keyed by shape
    decode = {b: {"points": [scale(p, factor[f"decode {b}"]) for p in d["points"]]} for b, d in raw["decode"].items()}
    # A corrected table (version 3) stays one: its serving-context factors are ratios to the closed surface, which
    # the rescaling moves, so they carry over as they are.
    return {**raw, "version": max(raw.get("version", 2), 2), "prefill": {"points": prefill}, "decode": decode,
            "fit": fit(prefill, {b: d["points"] for b, d in decode.items()}, raw.get("engine"))}


def source_table(path: Path, cfg) -> CostTable:
    """The table to refresh, refused before the engine starts unless this engine is the one it measured (model,
    dtype, block size): the ratios of another model's steps to its model would rescale it by nothing they share."""
    from servecap.traces.model_spec import MODELS, config_hash
    old = load_cost_table(path, allow_nonstationary=True)
    m, asked = old.model, {"config_hash": config_hash(cfg.serving.spec), "dtype": cfg.serving.dtype,
                 "block_size": cfg.serving.block_size}
    theirs = {"config_hash": m["config_hash"], "dtype": m["dtype"], "block_size": old.block_size}
    differ = [f"{k} {theirs[k]} (this engine: {v})" for k, v in asked.items() if theirs[k] != v]
    if differ:
        model = next((name for name, spec in MODELS.items() if config_hash(spec) == m["config_hash"]), None)
        options = [f"--model {model}"] * (model is not None and theirs["config_hash"] != asked["config_hash"]) + \
            [f"--device {'cpu' if m['dtype'] == 'float32' else 'cuda'}"] * (theirs["dtype"] != asked["dtype"])
        raise InputError(f"was measured on {m['name']} {m['dtype']}, not on this engine: {'; '.join(differ)}. Refresh "
                         f"it as it was measured{' (' + ', '.join(options) + ')' if options else ''}, or calibrate "
                         f"this engine anew", path=path)
    return old


def refresh(old: CostTable, source: Path, out: Path, cfg, argv: list[str], telemetry=None, by: str = "shapes",
            policies: tuple[str, ...] = (), requests: int = 0) -> int:
    """Re-measure `old` (read from `source`) on this GPU `by` shapes or serving (module docstring; serving: each of
    `policies` on a trace of `requests` requests, the runs kept in OUT.runs/) and write it rescaled to `out`;
    `telemetry` (a recording running through the refresh) is summarized in the table."""
    from servecap.engine.engine import Engine

    from .measure import measure

    t0 = time.perf_counter()
    cost = CostModel(old)
    engine = Engine(cfg)
    extra: dict = {}
    if by == "serving":
        folder = out.with_name(out.name + ".runs")
        measured, per_run = serving_ratios(engine, source, cost, old.backends, list(policies), folder, requests)
        labels = list(per_run)
    else:
        runs = refresh_runs(old.backends, cfg.serving.max_batch)
        measured = ratios(cost, runs, [measure(engine, r) for r in runs])
        labels = [r.label for r in runs]
    factor = {k: float(np.median(v)) for k, v in measured.items()}
    for b in old.backends:
        factor.setdefault(f"decode {b}", 1.0)
    if by == "serving":
        extra = {"runs_dir": str(folder), "by_run": per_run, "error": refresh_error(per_run, factor)}
        measured = {k: [r[k]["median"] for r in per_run.values() if k in r] for k in measured}
    meta = engine.metadata()
    table = rescaled(old.raw, factor)
    table.update(device=meta["device"], software=meta["software"], created_at=meta["created_at"],
                 git_commit=meta["git_commit"], host=meta["host"],
                 name=f"{old.raw['name']} (refreshed on {meta['device']['name']}{' from serving runs' * (by == 'serving')})",
                 refreshed_from={"table_id": old.table_id, "device": old.device, "created_at": old.created_at},
                 refresh={"by": by, "factors": factor, "ratios": measured, "runs": labels, **extra,
                          "wall_s": round(time.perf_counter() - t0, 1),
                          **({"telemetry": telemetry.summary()} if telemetry is not None else {}),
                          "command": shlex.join(["python", "-m", "calibrate", *argv])})
    if "stationarity" in table:
        table["stationarity"] = {**table["stationarity"], "measured_on": old.gpu_uuid or old.device_name}
    table.pop("table_id", None)
    tid = save_cost_table(table, out)
    print(f"refreshed {old.summary()} on {meta['device']['name']} (GPU {meta['device'].get('uuid')}) by {by}: "
          "measured / table " + ", ".join(f"{k} {f:.3f} (n={len(measured.get(k, []))})" for k, f in factor.items()))
    if extra.get("error", {}).get("sigma") is not None:
        e = extra["error"]
        print(f"its own error in a run's speed: mean {e['mean_log']:+.2%} over {e['runs']} runs, standard error "
              f"{e['standard_error']:.2%}")
    print(f"wrote cost table {tid} to {out} in {time.perf_counter() - t0:.0f} s")
    return 0
