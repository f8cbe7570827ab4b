"""`python -m calibrate --from-runs RUN_DIR ... --table T --out T2`: correct a cost table for serving from the steps of
real run records (the validation's, or a user's own serving logs), no GPU.

Every recorded step whose shape the record determines is priced by T at its shape (servecap/costs/recorded.py) and
put in its serving-context class (servecap/costs/context.py: previous step, idle gap, rows, a decode step's longest
row; the SM clock where the run recorded telemetry). The correction is each class's summed real over summed model
(class_factor: the 1% at either end of its real / model left out), and beside it the class's median real / model,
a typical step's price. The stretch-end term (seconds a decode step that ends its stretch holds over its price,
by the stretch's length) and the factors are fitted in turn, STRETCH_ROUNDS times: the factors on the steps' time
less their stretch end, the ends as the mean of what the ending steps of stretches of two steps or more hold over their
price inside a stretch (after a decode step; the 1% at either end left out), so that a stretch's end is not spread
over its other steps.
Held out by run (`holdout="run"`): the runs of each prefill policy, in path order, every HOLDOUT_EVERY-th is left out
of the fit, and the report (printed, and stored in the table) gives, on the held-out runs only, the median real /
model per step kind before and after the correction, each run's summed step time error before and after, and the
residual spread the intervals use (servecap/sim/intervals.py). The correction stored is the one fitted without the
held-out runs: the one the report grades. The table also stores which GPUs the held-out runs ran on and how far
apart those GPUs' mean errors lie (held_out_gpus): on runs from several GPUs, the residual spread holds the
GPU-to-GPU spread too.

Held out by point (`holdout="point"`, leave-one-point-out): a point is the runs of one trace on one configuration
(a validation's repeats, point_key). Repeats of one point are near copies of each other, so a run held out beside
its own repeats in the fit says little about traffic the correction has not seen. Here every point's runs are
priced by the correction fitted on all the other points, the report grades each run so, and the residual spread
is theirs; the correction stored is fitted on every run (none is left unused), and the report names it as such.

Held out by GPU (`holdout="gpu"`, leave-one-GPU-out): the same with a GPU's runs (its UUID) in place of a point's.
Held out by point, a run's GPU is still in its fit through that GPU's other points, so its residual holds little of
that GPU's offset; held out by GPU, each run is priced as on a GPU the correction never saw, which is what a
planner's new GPU is.
"""
from __future__ import annotations

import json
import math
import shlex
import warnings
from pathlib import Path

import numpy as np

from servecap.costs.context import IDLE_S, MIN_STEPS, Correction, keys, previous, stretch_end_keys
from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps, stretch_end_prices
from servecap.costs.table import CORRECTED_VERSION, CostTable, check_compatible, load_cost_table, save_cost_table
from servecap.traces.errors import InputError
from servecap.traces.provenance import git_commit, now_iso

HOLDOUT_EVERY = 3
TRIM_PCT = 1.0  # a class's steps outside this percentile of real / model at either end are left out of its factor
CLOCK_MIN_STEPS = 100  # steps with a recorded clock before its exponent is fitted
STRETCH_ROUNDS = 3  # factors and stretch ends fitted in turn (each round moves the ends less: README)


def find_runs(paths: list[Path]) -> list[Path]:
    """The complete engine run records at or under each path (a record's own subfolders, a fleet's replicas, are
    not searched: the record holds them)."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        meta = d / "meta.json"
        if meta.exists():
            m = json.loads(meta.read_text())
            if m.get("schema") == "run-record" and m.get("kind") == "engine" and m.get("status") == "complete":
                found.append(d)
            return
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            walk(sub)
    for p in map(Path, paths):
        if not p.is_dir():
            raise InputError("not a directory of run records", path=p)
        before = len(found)
        walk(p)
        if len(found) == before:
            raise InputError("holds no complete engine run record (meta.json with kind engine)", path=p)
    return list(dict.fromkeys(found))


def split(runs: dict[Path, dict], every: int = HOLDOUT_EVERY) -> tuple[list[Path], list[Path]]:
    """(fitted, held out): per prefill policy, in path order, every `every`-th run held out (none when a policy has
    fewer than two runs, or every is 0)."""
    by_policy: dict[str, list[Path]] = {}
    for path in sorted(runs):
        by_policy.setdefault(runs[path]["meta"].get("prefill", "padded").partition(":")[0], []).append(path)
    fit, held = [], []
    for paths in by_policy.values():
        for i, path in enumerate(paths):
            (held if every and len(paths) > 1 and i % every == every - 1 else fit).append(path)
    return fit, held


POINT_FIELDS = ("trace_id", "backend", "prefill", "admission", "max_batch", "pool_blocks", "prefix_cache",
                "max_num_batched_tokens")


def point_key(meta: dict) -> tuple:
    """What makes two runs repeats of one point: the same trace on the same serving configuration."""
    return tuple(str(meta.get(k)) for k in POINT_FIELDS)


def _prev(steps) -> list[str]:
    return [previous(k, i) for k, i in zip(steps.prev_kind, steps.idle_s)]


def class_factor(real: np.ndarray, model: np.ndarray) -> float:
    """A context class's factor: its steps' summed time over their summed price, the steps whose real / model lies
    outside the class's 1st-99th percentile left out. Sums, not a median: a run's time is a sum, and in serving a
    class's ratios are skewed (a step the device waited for the host on, near an arrival, is slower; none is much
    faster), so the median prices a run cheap; the trim keeps a rare stall (a collector pause) out of a small
    class."""
    body = _body(real / model)
    return float(real[body].sum() / model[body].sum())


def _body(x: np.ndarray) -> np.ndarray:
    """Where x lies within its TRIM_PCT-th to (100 - TRIM_PCT)-th percentile, taken at values of x (the outer ones
    kept: a small set keeps every value)."""
    lo, hi = np.percentile(x, TRIM_PCT, method="lower"), np.percentile(x, 100 - TRIM_PCT, method="higher")
    return (x >= lo) & (x <= hi)


def classes(steps) -> dict[str, np.ndarray]:
    """Each context class's steps (every key level of costs.context.keys), as positions in `steps`, by key."""
    got: dict[str, list[int]] = {}
    for i, (k, p, rows, kv, tokens, total) in enumerate(zip(steps.kind, _prev(steps), steps.rows, steps.kv_max,
                                                              steps.tokens, steps.kv_tokens)):
        for key in keys(k, p, int(rows), int(kv), int(tokens), int(total)):
            got.setdefault(key, []).append(i)
    return {k: np.asarray(v) for k, v in sorted(got.items())}


def trimmed_mean(x: np.ndarray) -> float:
    """The mean of x with the values outside its 1st-99th percentile left out (a small set keeps every value)."""
    return float(x[_body(x)].mean())


def end_classes(steps) -> dict[str, np.ndarray]:
    """The steps that end a decode stretch of two steps or more (a one-step stretch's only step is also its first,
    whose context factor its end cannot be told apart from), by stretch-end key (every level of
    costs.context.stretch_end_keys)."""
    got: dict[str, list[int]] = {}
    for i, (kind, n) in enumerate(zip(steps.kind.tolist(), steps.stretch_end.tolist())):
        if n >= 2:
            for key in stretch_end_keys(kind, n):
                got.setdefault(key, []).append(i)
    return {k: np.asarray(v) for k, v in sorted(got.items())}


def fit(steps, by_class: dict[str, np.ndarray] | None = None) -> dict:
    """The correction's factors (every key level of costs.context.keys, with its step count), stretch ends and
    clock term; `by_class`: classes(steps), where the caller has it already."""
    real = (steps.real_s - steps.retire_s).to_numpy()  # the factors scale steps, not retirement
    model = steps.model_s.to_numpy()
    by_class = classes(steps) if by_class is None else by_class
    by_end = end_classes(steps)
    correction = {"method": f"summed real / summed model per (step kind, context class), steps outside the "
                            f"class's {TRIM_PCT:g}th-{100 - TRIM_PCT:g}th percentile of real / model left out",
                  "idle_s": IDLE_S, "min_steps": MIN_STEPS, "clock": None}
    held = np.zeros(len(steps))  # each step's stretch end, as the last round fitted it
    ending = np.flatnonzero(steps.stretch_end.to_numpy() > 0)  # the steps that hold one (a few in ten)
    inside = steps.iloc[ending].assign(prev_kind="decode", idle_s=0.0, retire_s=0.0, stretch_end=0)
    over = np.zeros(len(steps))
    for _ in range(STRETCH_ROUNDS if by_end else 1):
        own = real - held
        correction["factors"] = {k: {"factor": class_factor(own[v], model[v]),
                                     "median": float(np.median(own[v] / model[v])), "n": len(v)}
                                 for k, v in by_class.items()}
        if not by_end:
            break
        # An ending step over the price it would have inside a stretch (after a decode step): a one-step stretch's
        # steps all end one, so their own class cannot tell its factor from its end.
        over[ending] = real[ending] - _priced(inside, correction)
        ends = {k: {"s": max(0.0, trimmed_mean(over[v])), "n": len(v)} for k, v in by_end.items()}
        correction["stretch_end"] = {"method": "mean seconds a decode step that ends a stretch of two steps or more "
                                               "holds over its price inside a stretch, by the stretch's steps",
                                     "ends": ends}
        held[ending] = stretch_end_prices(steps.iloc[ending], Correction(correction))
    clocked = steps[np.isfinite(steps.clock_mhz.astype(float))]
    if len(clocked) >= CLOCK_MIN_STEPS:
        ref = float(np.median(clocked.clock_mhz))
        x = np.log(ref / clocked.clock_mhz.to_numpy(float))
        if np.std(x) > 0.005:  # the clock moved: its exponent is measurable
            base = _priced(clocked, correction)
            r = np.log(clocked.real_s.to_numpy() / base)
            correction["clock"] = {"reference_mhz": ref, "exponent": float(np.dot(x, r) / np.dot(x, x)),
                                   "n": int(len(clocked))}
    return correction


def _priced(steps, correction: dict | None, typical: bool = False) -> np.ndarray:
    """Each step's model price times the correction's factor (none: the table's price; `typical`: its median)."""
    return contextual(steps, Correction(correction) if correction else None, typical)


def _rms(v: list[float]) -> float | None:
    return float(math.sqrt(np.mean(np.square(v)))) if len(v) >= 2 else None


def evaluate(by_run: dict[Path, "object"], correction: dict | None, own: dict[Path, dict] | None = None) -> dict:
    """On these runs: median real / model per step kind (and per kind and previous step) before and after the
    correction (or each run's own, where `own` gives it; after: over a typical step's price, the class medians);
    each run's summed step time error, (model - real) / real, before and after; the log residual RMS over runs of
    each kind's summed steps after it (the intervals' cost-model term)."""
    import pandas as pd

    if not by_run:
        return {}
    rows = []
    for path, s in by_run.items():
        c = (own or {}).get(path, correction)
        rows.append(s.assign(run=str(path), prev=_prev(s), before=_priced(s, None), after=_priced(s, c),
                             typical=_priced(s, c, typical=True)))
    steps = pd.concat(rows, ignore_index=True)

    def medians(group_cols):
        out = {}
        for key, g in steps.groupby(group_cols):
            key = key if isinstance(key, str) else " | ".join(key)
            out[key] = {"n": int(len(g)), "before": float(np.median(g.real_s / g.before)),
                        "after": float(np.median(g.real_s / g.typical))}
        return out
    runs, sigma = {}, {}
    for run, g in steps.groupby("run"):
        real = g.real_s.sum()
        runs[run] = {"steps": int(len(g)), "before": float(g.before.sum() / real - 1),
                     "after": float(g.after.sum() / real - 1)}
    for kind, g in steps.groupby("kind"):
        logs = [float(np.log(h.real_s.sum() / h.after.sum())) for _, h in g.groupby("run")]
        sigma[kind] = _rms(logs)
    sigma["all"] = _rms([float(np.log(1 / (1 + r["after"]))) for r in runs.values()])
    return {"kinds": medians("kind"), "contexts": medians(["kind", "prev"]), "runs": runs, "residual_sigma": sigma}


def gpu_key(meta: dict, option: str = "--holdout gpu") -> str:
    """The GPU a run ran on: its device's UUID, refused (naming `option`, what groups runs by GPU) where it has none."""
    uuid = (meta.get("device") or {}).get("uuid")
    if not uuid:
        raise InputError(f"{option} needs every run's GPU UUID; this run records none (device.uuid)")
    return uuid


# how each holdout groups runs: (key, a group's name, the groups' name in an error)
GROUPS = {"point": (point_key, "point", "points (trace and configuration)"), "gpu": (gpu_key, "GPU", "GPUs")}


def leave_one_out(runs: dict[Path, dict], by: str = "point") -> tuple[dict, dict[Path, dict]]:
    """(the correction fitted on every run, each run's correction fitted without the runs of its group): `by` point,
    or gpu."""
    import pandas as pd

    key, _, named = GROUPS[by]
    by_group: dict[tuple | str, list[Path]] = {}
    for path in sorted(runs):
        try:
            by_group.setdefault(key(runs[path]["meta"]), []).append(path)
        except InputError as e:
            raise InputError(str(e), path=path) from None
    if len(by_group) < 2:
        raise InputError(f"--holdout {by} needs runs of two or more {named}; these {len(runs)} run(s) are all of one")
    # Every step's classes once (a Python pass over every step), then each group's fit from those classes less its
    # own steps: the same steps in the same order as a fit of the other groups' runs, so the same factors.
    every = pd.concat([r["steps"] for r in runs.values()], ignore_index=True)
    run_of = np.repeat(np.arange(len(runs)), [len(r["steps"]) for r in runs.values()])
    index = {path: i for i, path in enumerate(runs)}
    by_class = classes(every)
    own = {}
    for paths in by_group.values():
        keep = ~np.isin(run_of, [index[p] for p in paths])
        at = np.cumsum(keep) - 1  # a kept step's position among the kept
        rest = {k: at[v[keep[v]]] for k, v in by_class.items() if keep[v].any()}
        own.update(dict.fromkeys(paths, fit(every[keep].reset_index(drop=True), rest)))
    return fit(every, by_class), own


def held_out_gpus(held: dict[str, dict], runs: dict[Path, dict]) -> dict:
    """How many GPUs the held-out runs ran on (the device UUID their records name), and the sd over those GPUs of
    each one's mean log(real / corrected price) per run (None under two)."""
    by_gpu: dict[str, list[float]] = {}
    for path, r in held.items():
        uuid = (runs[Path(path)]["meta"].get("device") or {}).get("uuid")
        if uuid:
            by_gpu.setdefault(uuid, []).append(math.log(1 / (1 + r["after"])))
    means = [float(np.mean(v)) for v in by_gpu.values()]
    return {"n": len(by_gpu), "sd_of_means": float(np.std(means, ddof=1)) if len(means) >= 2 else None}


def load_runs(paths: list[Path], table: CostTable) -> dict[Path, dict]:
    """The complete engine run records under `paths` (find_runs), each as {"meta", "steps"}: its steps priced by
    `table` in their context (costs/recorded.py), refused (one line) unless the table measured the run's model, block
    size, decode backend and GPU kind."""
    from servecap.traces.records import read_run
    from servecap.traces.telemetry import read_telemetry

    cost = CostModel(table)
    runs = {}
    for d in find_runs(paths):
        rec = read_run(d)
        try:
            check_compatible(table, rec.meta["model"]["config_hash"], rec.meta["block_size"])
        except InputError as e:
            raise InputError(str(e), path=d) from None
        if rec.meta["backend"] not in table.backends:
            raise InputError(f"ran decode backend {rec.meta['backend']!r}, which the table has no costs for", path=d)
        ran_on = (rec.meta.get("device") or {}).get("name")
        if ran_on and ran_on != table.device_name:
            # A correction is a ratio to the table's closed prices, and those ratios differ between GPU kinds
            # (README: the H200's correction priced an H100's prefill 2-3% low).
            raise InputError(f"ran on {ran_on}, but cost table {table.table_id} was measured on {table.device_name}: "
                             f"correct a table calibrated on {ran_on}", path=d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a serving run's shapes past the table's range are priced as they are
            steps = priced_steps(rec, cost, read_telemetry(d))
        runs[d] = {"meta": rec.meta, "steps": steps}
    return runs


def table_and_runs(paths: list[Path], table_path: Path, out: Path, force: bool) -> tuple[CostTable, dict[Path, dict]]:
    """The table at `table_path` and the runs under `paths` priced by it (load_runs), once `out` is known free (or
    `force`) and the table is of version 2 or later."""
    if out.exists() and not force:
        raise InputError("already exists; pass --force to replace it", path=out)
    table = load_cost_table(table_path, allow_nonstationary=True)
    if table.version < 2:
        raise InputError("is a version-1 table; rebuild it with --refit first", path=table_path)
    return table, load_runs(paths, table)


HOLDOUTS = ("run", "point", "gpu")


def from_runs(paths: list[Path], table_path: Path, out: Path, argv: list[str], force: bool = False,
              every: int = HOLDOUT_EVERY, holdout: str = "run") -> tuple[str, dict]:
    """Write `table_path` corrected from the runs under `paths` to `out`; return its id and the report (`holdout`:
    the module docstring's two ways of holding runs out)."""
    import pandas as pd

    table, runs = table_and_runs(paths, table_path, out, force)
    if holdout in GROUPS:
        correction, own = leave_one_out(runs, holdout)
        fitted, held = sorted(runs), sorted(runs)
        report = {"held_out": evaluate({p: runs[p]["steps"] for p in held}, correction, own), "holdout": holdout}
        one = GROUPS[holdout][1]
        sigma_from = f"held-out {one}s (each run priced by the correction fitted without its {one}'s runs)"
    else:
        fitted, held = split(runs, every)
        correction = fit(pd.concat([runs[p]["steps"] for p in fitted], ignore_index=True))
        report = {"held_out": evaluate({p: runs[p]["steps"] for p in held}, correction),
                  "fitted": evaluate({p: runs[p]["steps"] for p in fitted}, correction), "holdout": holdout}
        sigma_from = "held-out runs" if held else "the fitted runs (nothing held out)"
    report["held_out_gpus"] = held_out_gpus(report["held_out"].get("runs", {}), runs)
    report["stretch_end"] = (correction.get("stretch_end") or {}).get("ends", {})
    correction.update(residual_sigma=report["held_out"].get("residual_sigma") or report["fitted"]["residual_sigma"],
                      residual_sigma_from=sigma_from, holdout=holdout,
                      fitted_runs=[str(p) for p in fitted], held_out_runs=[str(p) for p in held],
                      held_out_gpus=report["held_out_gpus"],
                      held_out=report["held_out"], created_at=now_iso(), git_commit=git_commit(),
                      command=shlex.join(["python", "-m", "calibrate", *argv]))
    raw = {k: v for k, v in table.raw.items() if k not in ("table_id", "correction")}
    raw.update(version=CORRECTED_VERSION, correction=correction, created_at=correction["created_at"],
               corrected_from={"table_id": table.table_id, "created_at": table.created_at,
                               "git_commit": table.raw.get("git_commit")})
    return save_cost_table(raw, out), report


def describe(report: dict) -> str:
    """The report as text: held-out medians per kind, per kind and previous step, and each run's summed error."""
    lines = []
    for part in ("held_out", "fitted"):
        r = report.get(part)
        if not r:
            continue
        one = GROUPS.get(report.get("holdout"), (None, None))[1]
        who = (f"held-out {one}s (each run priced by the correction fitted without its {one})"
               if part == "held_out" and one else f"{part.replace('_', '-')} runs")
        lines.append(f"{who}: median real / model per step kind, before -> after")
        lines += [f"  {k:28s} n={v['n']:6d}  {v['before']:.3f} -> {v['after']:.3f}" for k, v in r["kinds"].items()]
        lines.append("  by previous step:")
        lines += [f"  {k:40s} n={v['n']:6d}  {v['before']:.3f} -> {v['after']:.3f}" for k, v in r["contexts"].items()]
        lines.append("  summed step time error per run, (model - real) / real, before -> after:")
        lines += [f"  {k:70s} {v['before']:+.1%} -> {v['after']:+.1%}" for k, v in r["runs"].items()]
        lines.append("  log residual RMS over runs (after): " + ", ".join(
            f"{k} {v:.3f}" for k, v in r["residual_sigma"].items() if v is not None))
        gpus = report.get("held_out_gpus") if part == "held_out" else None
        if gpus and gpus["n"]:
            spread = f", whose mean log errors spread by sd {gpus['sd_of_means']:.3f}" if gpus["sd_of_means"] else ""
            lines.append(f"  the held-out runs ran on {gpus['n']} GPU(s){spread}")
    lines += stretch_end_lines(report.get("stretch_end") or {})
    return "\n".join(lines)


def stretch_end_lines(ends: dict) -> list[str]:
    """The stored correction's stretch ends (its `stretch_end.ends`), a line a decode kind: ms by stretch length."""
    if not ends:
        return []
    out = [f"stretch ends of the stored correction, ms by the stretch's steps (ending steps fitted on; * under "
           f"{MIN_STEPS}: the kind's is used):"]
    for kind in sorted(k for k in ends if "|" not in k):
        mine = [(k.split("|")[1], v) for k, v in ends.items() if k.startswith(kind + "|")]
        mine.sort(key=lambda kv: int(kv[0][1:].split("-")[0].rstrip("+")))
        out.append(f"  {kind:22s} all {1e3 * ends[kind]['s']:.3f} ({ends[kind]['n']})" + "".join(
            f", {b} {1e3 * v['s']:.3f} ({v['n']}{'*' if v['n'] < MIN_STEPS else ''})" for b, v in mine))
    return out
