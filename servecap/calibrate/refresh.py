"""A cost table refreshed for this GPU: a few of its shapes re-measured here, its points rescaled by what changed.

Two GPUs of the same name differ a little (clocks, memory, the host). A whole calibration takes minutes; a refresh
re-measures a handful of decode and prefill shapes, takes the median ratio of measured to the table's model per
kind (prefill; decode per backend), rescales the table's points by the factors it applies, refits, and writes a
table that names the one it was refreshed from, every factor, those applied, the ratios and this GPU.

On a GPU of the table's own name the prefill factor is recorded and not applied: over blind validations on many
such GPUs the closed prefill shapes' reading did not follow the GPU's serving prefill speed, where the decode
reading did (README, validation v22; `scripts/refresh_retro.py`). On another GPU the prefill factor is applied too.

A table corrected from serving runs on SPANNED_GPUS or more GPUs of its kind is refreshed with a warning: graded
blind against the same runs, such tables predicted as well or better unrefreshed, on either GPU kind, whether
refreshed by closed shapes or by a serving probe (README, validation v32): the correction already prices the kind's
spread in serving, to which a reading on one GPU adds its own error.
"""
from __future__ import annotations

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

SPANNED_GPUS = 3  # from three GPUs on, unrefreshed won (H100 v29, v30, v32); from two it tied (v28)
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


def applied(factor: dict[str, float], same_gpu: bool) -> dict[str, float]:
    """The factors a refresh rescales by: all of them on another GPU, the decode ones alone on a GPU of the table's
    own name (module docstring)."""
    return {k: f for k, f in factor.items() if not (same_gpu and k == "prefill")}


def rescaled(raw: dict, factor: dict[str, float]) -> dict:
    """The table's points with each kind's times multiplied by its factor, refitted."""
    def scale(p: dict, f: float) -> dict:
        return {**p, **{k: p[k] * f for k in ("median_s", "p10_s", "p90_s")}}
    prefill = [scale(p, factor.get("prefill", 1.0)) for p in CostTable(raw).prefill_points()]  # keyed by shape
    decode = {b: {"points": [scale(p, factor.get(f"decode {b}", 1.0)) for p in d["points"]]}
              for b, d in raw["decode"].items()}
    # A corrected table (version 3) stays one: its serving-context factors are ratios to the closed surface, which
    # the rescaling moves, so they carry over as they are.
    return {**raw, "version": max(raw.get("version", 2), 2), "prefill": {"points": prefill}, "decode": decode,
            "fit": fit(prefill, {b: d["points"] for b, d in decode.items()}, raw.get("engine"))}


def refreshed_from(table: CostTable) -> dict:
    """What a table rescaled from `table` records of its source: its id, device and time."""
    return {"table_id": table.table_id, "device": table.device, "created_at": table.created_at}


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
    gpus = spanned_gpus(old)
    if gpus >= SPANNED_GPUS:
        warnings.warn(f"{path}'s correction already prices serving on {gpus} GPUs of its kind, and such tables "
                      "predicted as well or better unrefreshed (README, validation v32): refresh it for another GPU "
                      "kind or driver, or plan with both", stacklevel=2)
    return old


def spanned_gpus(table: CostTable) -> int:
    """How many GPUs the runs that graded the table's serving correction ran on (0 for none)."""
    return ((table.correction or {}).get("held_out_gpus") or {}).get("n", 0)


def refresh(old: CostTable, out: Path, cfg, argv: list[str], telemetry=None) -> int:
    """Re-measure `old`'s refresh shapes on this GPU and write it rescaled to `out`; `telemetry` (a recording
    running through the refresh) is summarized in the table."""
    from servecap.engine.engine import Engine

    from .measure import measure

    t0 = time.perf_counter()
    cost = CostModel(old)
    engine = Engine(cfg)
    runs = refresh_runs(old.backends, cfg.serving.max_batch)
    samples = [measure(engine, r) for r in runs]
    measured = ratios(cost, runs, samples)
    factor = {k: float(np.median(v)) for k, v in measured.items()}
    for b in old.backends:
        factor.setdefault(f"decode {b}", 1.0)
    meta = engine.metadata()
    applies = applied(factor, same_gpu=meta["device"]["name"] == old.device_name)
    table = rescaled(old.raw, applies)
    table.update(device=meta["device"], software=meta["software"], created_at=meta["created_at"],
                 git_commit=meta["git_commit"], host=meta["host"],
                 name=f"{old.raw['name']} (refreshed on {meta['device']['name']})",
                 refreshed_from=refreshed_from(old),
                 refresh={"factors": factor, "applied": applies, "ratios": measured, "runs": [r.label for r in runs],
                          "wall_s": round(time.perf_counter() - t0, 1),
                          **({"telemetry": telemetry.summary()} if telemetry is not None else {}),
                          "command": shlex.join(["python", "-m", "calibrate", *argv])})
    if "stationarity" in table:
        table["stationarity"] = {**table["stationarity"], "measured_on": old.gpu_uuid or old.device_name}
    table.pop("table_id", None)
    tid = save_cost_table(table, out)
    print(f"refreshed {old.summary()} on {meta['device']['name']} (GPU {meta['device'].get('uuid')}): measured / "
          "table " + ", ".join(f"{k} {f:.3f} (n={len(measured.get(k, []))}{'' if k in applies else ', not applied'})"
                               for k, f in factor.items()))
    print(f"wrote cost table {tid} to {out} in {time.perf_counter() - t0:.0f} s")
    return 0
