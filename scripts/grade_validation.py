"""The README's grading of a validation's real runs against its frozen plan, per the issues' targets.

Usage: PYTHONPATH=. python scripts/grade_validation.py VALIDATION [VALIDATION ...] [--by CONTEXT] [--segments]
         [--replan TABLE [--work DIR] | --against PLAN_DIR | --unrefreshed]

For each validation directory (plan.json and real/POINT/run-K, as `python -m validate plan` and `real` make them),
compared with its plan under the protocol checks of servecap/validate/comparison.py, on the plan's own table:
- at every arrival point, the mean of its repeats: served rate error, and TTFT p50 error against max(10%, the
  repeats' spread, (max - min) / median);
- each run's summed step time over its price in context (servecap/costs/recorded.py), by decode and prefill steps,
  beside the GPU's median SM clock, temperature and power over the run where it recorded telemetry; and the median
  real / price per step kind, the price a typical step's (a correction's class medians, where it has them);
- the plan's 90% bands: the share of every run's measurements inside (servecap/validate/coverage.py), by the
  points' role (public, mixed, prefix-cache), and near and past capacity, with how many bands are within twice
  their repeats' spread;
- given several validations, every run's error pooled and the sd of the validations' mean log speeds, how well a
  point's mean speed is told by its validation's other points (by those of its policy alone, by none, by the
  first two points run on its GPU), each prefill policy's decode steps' summed real / price over its runs (a
  policy whose decode runs off its price on one GPU alone is that GPU, not the cost model), and the bands'
  coverage near and past capacity pooled the same way, and, at points of one plan run on several GPUs, within
  twice the spread of all their runs.
With --by, the summed real / price of every run's decode and prefill steps binned by one context a correction has
no class for: the requests waiting at the step's start (`queue`, servecap/traces/metrics.queue_depth), the share of
the BUSY_S seconds before it the engine spent in steps (`busy`: a GPU's power and clock follow its duty cycle), the
SM clock last sampled before it (`clock`), the GPU's temperature (`temperature`), a prefill step's positions
(`tokens`), or the token bucket the engine ran it at (`bucket`, each its own bin), to tell what a miss follows.
With --segments, each run's line also gives its summed real / price in the first 10% of its time, the next 15%,
the next 25% and the second half: whether a run's speed drifts through it (a warm-up) or holds from its start.
With --replan TABLE, each validation is graded against a plan re-made from TABLE on its points and traces, with 90%
bands (in --work, else a temporary directory): what another table would have predicted. A retrospective, never
blind: that plan is made after the runs (the protocol checks stay the validation's own plan's).
With --against PLAN_DIR, each validation is graded against that committed plan of the same points instead, on its
table: a refreshed validation's runs against the unrefreshed plan it was made from (`--points-from`), blind where
PLAN_DIR was committed before the runs (git log says so; README, validations v32 and v34).
With --unrefreshed, each validation planned from a refreshed table is graded so against the plan its points came
from (its plan's `points_from`), the others against their own: a pool of sessions, refreshed or not, graded on the
tables as they are, in one command.
Given several validations, the targets are also summed over them (targets_line).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps
from servecap.sim import inputs
from servecap.traces.command import Parser, command
from servecap.traces.errors import InputError
from servecap.traces.metrics import queue_depth
from servecap.traces.records import read_run
from servecap.traces.telemetry import join_steps, read_telemetry
from servecap.validate.comparison import compare, plan_table
from servecap.validate.coverage import coverage
from servecap.validate.points import complete_dirs
from servecap.validate.plan import make_plan


# --by: (bin edges, None: each value its own bin; the column binned; which steps)
BINS = {"bucket": (None, "bucket", "prefill"),
        "busy": ((-0.01, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0), "busy", None),
        "queue": ((-1, 0, 5, 20, 50, 100, 200, 400, np.inf), "queue", None),
        "clock": ((0, 1600, 1700, 1800, 1900, 1950, 2000), "sampled_clock_mhz", None),
        "temperature": ((0, 50, 55, 60, 65, 70, 100), "temperature_c", None),
        "tokens": ((0, 256, 512, 1024, 2048, 4096, 8192, np.inf), "tokens", "prefill")}


BUSY_S = 0.5
SEGMENTS = (0.1, 0.25, 0.5)  # --segments: the shares of a run's time its segments end at (the last ends at 1)


def busy_share(record_steps, at, replica, window: float = BUSY_S) -> np.ndarray:
    """The share of the `window` seconds before each time `at` that `replica` spent in the record's steps (all of
    them: a chunk step the pricing leaves out took the GPU all the same)."""
    out = np.zeros(len(at))
    at, replica = np.asarray(at, float), np.asarray(replica)
    for r, steps in record_steps.groupby("replica"):
        steps = steps.sort_values("start")
        start, end = steps.start.to_numpy(float), steps.end.to_numpy(float)
        done = np.r_[0.0, np.cumsum(end - start)]
        mine = replica == r
        t = at[mine]
        first = np.searchsorted(end, t - window, side="right")  # the first step still running at the window's start
        last = np.searchsorted(start, t, side="left")  # the steps that started before t
        edge = np.minimum(first, len(start) - 1)
        before = np.clip(t - window - start[edge], 0, None)  # the first step's part before the window
        after = np.clip(end[np.maximum(last - 1, 0)] - t, 0, None)  # the last one's part after t, if it runs on
        out[mine] = np.where(last > first, done[last] - done[first] - before - after, 0.0) / window
    return np.clip(out, 0.0, 1.0)


def by_segment(steps) -> list[float]:
    """The steps' summed real over summed price in each segment of the run's time (SEGMENTS), by their start."""
    t = steps.start.to_numpy(float)
    segment = np.digitize(t, t.min() + (t.max() - t.min()) * np.array(SEGMENTS))
    return [float(steps.real_s[segment == i].sum() / steps.price[segment == i].sum())
            for i in range(len(SEGMENTS) + 1)]


def _binned(steps, by: str) -> list[str]:
    edges, column, only = BINS[by]
    if only:
        steps = steps[steps.step_kind == only]
    s = steps.assign(bin=steps[column] if edges is None else pd.cut(steps[column], edges)).dropna(subset=["bin"])
    g = s.groupby(["step_kind", "bin"], observed=True).agg(n=("real_s", "size"), real=("real_s", "sum"),
                                                            price=("price", "sum"))
    return [f"    {kind:8s} {by} {str(b):16s} n={int(row.n):6d} {row.real / row.price:.3f}"
            for (kind, b), row in g.iterrows()]


class Graded(NamedTuple):
    """One validation's grading: each run's summed real / price in context (`runs`: `total`, `decode`, `prefill`,
    beside its point's `policy` and `load`), the plan's bands' coverage over every point (`bands["all"]`) and over
    the near and the past capacity points, each point's prediction beside its runs with the plan's bands
    (`compared`, for across_gpus), its arrival points' grades (`targets`, target's tuples) and each step kind's
    median real / price (`kinds`, unrounded)."""
    runs: pd.DataFrame
    bands: dict
    compared: tuple[list, dict]
    targets: list[tuple[str, float, float, float, bool]]
    kinds: dict[str, float]


def planned(validation: Path, replanned: tuple[Path, Path] | None = None) -> tuple[dict, list, Path]:
    """The plan, each point's prediction beside its real runs (servecap/validate/comparison.py) and the plan's table
    path: the validation's own plan's, or with `replanned` (a plan directory of its points, its table) that plan's
    predictions against the same runs."""
    table_path = plan_table(validation)
    plan, results = compare(validation, table_path)
    if replanned is not None:
        plan_dir, table_path = replanned
        plan = json.loads((plan_dir / "plan.json").read_text())
        results = [replace(c, sim=plan["predictions"][c.point.id]) for c in results]
    return plan, results, table_path


def target(c) -> tuple[str, float, float, float, bool]:
    """An arrival point's grade: (id, served rate error, TTFT p50 error, the repeats' TTFT spread, whether the TTFT
    error is within max(10%, spread)), errors of the prediction against the mean of the repeats."""
    served = float(np.mean([m["served_rate"] for m in c.real]))
    ttft = [m["ttft_p50"] for m in c.real]
    spread = (max(ttft) - min(ttft)) / float(np.median(ttft)) if len(ttft) > 1 else 0.0
    e_ttft = c.sim["ttft_p50"] / float(np.mean(ttft)) - 1
    return c.point.id, c.sim["served_rate"] / served - 1, e_ttft, spread, abs(e_ttft) <= max(0.10, spread)


def _summed(steps) -> float:
    """Steps' summed real time over their summed price (NaN for none)."""
    return float(steps.real_s.sum() / steps.price.sum()) if len(steps) else np.nan


def grade(validation: Path, by: str | None = None, replanned: tuple[Path, Path] | None = None,
          segments: bool = False) -> Graded:
    """Print the validation's grading (module docstring) and return it (Graded).
    `replanned` (a plan directory of the same points and the table it was made from): grade the runs against that
    plan instead, one made after them (a retrospective: the protocol checks are the validation's own plan's)."""
    plan, results, table_path = planned(validation, replanned)
    cost = CostModel(inputs.load_table(table_path))
    targets, runs, kinds, per_run, every = [], [], {}, [], []
    for c in results:
        for d in complete_dirs(validation, c.point):
            rec, telemetry = read_run(d), read_telemetry(d)
            steps = priced_steps(rec, cost)  # at the reference clock, as the simulator priced the prediction
            steps = steps.assign(price=contextual(steps, cost.correction))
            decode = steps.step_kind == "decode"  # the others: prefill, chunk and fused steps, the rescale's `prefill`
            runs.append({"point": c.point.id, "policy": c.point.serving.prefill.name, "load": c.point.load,
                         "total": _summed(steps), "decode": _summed(steps[decode]), "prefill": _summed(steps[~decode]),
                         "started": rec.meta.get("created_at")})
            by_kind = ", ".join(f"{kind} {_summed(g):.3f}" for kind, g in steps.groupby("step_kind"))
            gpu = ("" if telemetry is None or not len(telemetry) else
                   f"; SM clock {telemetry.sm_clock_mhz.median():.0f} MHz, {telemetry.temperature_c.median():.0f} C, "
                   f"{telemetry.power_w.median():.0f} W (medians)")
            per_run.append(f"  {c.point.id}/{d.name}: {runs[-1]['total']:.3f} ({by_kind}){gpu}" + (
                "; by time " + "/".join(f"{x:.3f}" for x in by_segment(steps)) if segments else ""))
            if by:  # the contexts a step is binned by, for --by alone
                every.append(steps.assign(queue=queue_depth(rec, steps.start),
                                          busy=busy_share(rec.steps, steps.start, steps.replica),
                                          bucket=cost.rounding.bucket(steps.tokens.to_numpy()),
                                          **_sampled(steps, telemetry)))
            typical = contextual(steps, cost.correction, typical=True)
            for kind, r in (steps.real_s / typical).groupby(steps.kind):
                kinds.setdefault(kind, []).extend(r.tolist())
        if c.point.trace.get("kind") == "closed-mixed":
            continue
        targets.append(target(c))
    if not runs:
        raise InputError("holds no complete real runs of its plan's points (real/POINT/run-K)", path=validation)
    print(f"{validation} (table {plan['table']['id']}): {len(targets)} arrival points; served within 2%: "
          f"{sum(abs(t[1]) <= 0.02 for t in targets)}, within 3%: {sum(abs(t[1]) <= 0.03 for t in targets)}; "
          f"TTFT p50 within max(10%, spread): {sum(t[4] for t in targets)}")
    for pid, e_s, e_t, spread, ok in targets:
        print(f"  {pid:34s} served {e_s:+.1%}  TTFT p50 {e_t:+.1%} (spread {spread:.0%}) {'ok' if ok else 'MISS'}")
    runs = pd.DataFrame(runs)
    r = runs.total.to_numpy()
    print(f"  each run's summed step time real / price in context: {r.min():.3f}-{r.max():.3f}, within 2%: "
          f"{int((abs(r - 1) <= 0.02).sum())} of {len(r)}")
    print("\n".join(per_run))
    for kind, v in sorted(kinds.items()):
        print(f"  median real / price in context, {kind:22s} n={len(v):6d} {np.median(v):.3f}")
    medians = {kind: float(np.median(v)) for kind, v in kinds.items()}
    print(f"  step kinds within 2% (unrounded medians): {sum(abs(m - 1) <= 0.02 for m in medians.values())} of "
          f"{len(medians)}")
    bands = plan.get("intervals", {}).get("bands", {})
    for role in dict.fromkeys(c.point.role for c in results):
        cov = coverage([c for c in results if c.point.role == role], bands)
        if cov["graded"]:
            widths = ", ".join(f"{m} {cov['metrics'][m]['median_rel_width']:.1%}" for m in ("served_rate", "ttft_p50")
                               if m in cov["metrics"])
            print(f"  90% bands, {role} points: {cov['inside']} of {cov['graded']} inside ({cov['share']:.1%}); "
                  f"median width / prediction: {widths}")
    by_load = {"all": coverage(results, bands),
               **{load: coverage([c for c in results if c.point.load == load], bands) for load in ("near", "past")}}
    for line in filter(None, (band_line(load, [by_load[load]]) for load in ("near", "past"))):
        print(line)
    if by:
        print(f"  summed real / price in context by {by}, every run:")
        print("\n".join(_binned(pd.concat(every, ignore_index=True), by)))
    return Graded(runs, by_load, (results, bands), targets, medians)


def target_counts(graded: dict[Path, Graded]) -> dict[str, tuple[int, int]]:
    """The issues' targets summed over several validations, each (met, of): arrival points with their served rate
    within 2% (`served`) and their TTFT p50 within max(10%, spread) (`ttft`), runs whose summed step time is within 2%
    (`runs`), and step kinds whose median real / price is within 2% (`kinds`: each validation's kinds counted apart,
    on unrounded medians)."""
    targets = [t for g in graded.values() for t in g.targets]
    runs = np.concatenate([g.runs.total.to_numpy() for g in graded.values()])
    kinds = [m for g in graded.values() for m in g.kinds.values()]
    return {"served": (sum(abs(t[1]) <= 0.02 for t in targets), len(targets)),
            "ttft": (sum(t[4] for t in targets), len(targets)),
            "runs": (int((abs(runs - 1) <= 0.02).sum()), len(runs)),
            "kinds": (sum(abs(m - 1) <= 0.02 for m in kinds), len(kinds))}


def targets_line(graded: dict[Path, Graded]) -> str:
    """target_counts as one line."""
    c = target_counts(graded)
    return (f"targets over {len(graded)} validations: {c['served'][1]} arrival points, served within 2% "
            f"{c['served'][0]}, TTFT p50 within max(10%, spread) {c['ttft'][0]}; runs within 2% {c['runs'][0]} of "
            f"{c['runs'][1]}; step kinds within 2% {c['kinds'][0]} of {c['kinds'][1]}")


def pooled(runs: dict[Path, pd.DataFrame], bands: dict[Path, dict] | None = None) -> str:
    """Every run's error over several validations, and how their mean speeds spread (a refreshed validation's
    directory is one GPU's session): what a band's cost sigma has to cover; each policy's decode steps by load; each
    validation's prompt steps by policy (on H100s they fell in two groups about 3% apart: README, validation v39)
    and how its decode and prompt speeds move together; given each validation's coverage by load (grade's), the
    bands pooled by load."""
    logs = {v: np.log(r.total.to_numpy()) for v, r in runs.items() if len(r)}
    every = np.concatenate(list(logs.values()))
    means = [float(x.mean()) for x in logs.values()]
    spread = f"sd {np.std(means, ddof=1):.2%}" if len(means) > 1 else "one validation"
    lines = [f"over {len(logs)} validations: every run's summed step time real / price in context, RMS of the log "
             f"{np.sqrt(np.mean(every ** 2)):.2%} ({len(every)} runs); the validations' mean log speeds: {spread}"]
    lines.append(_guessed_speeds(runs))
    if any("started" in r for r in runs.values()):
        lines.append(_read_first(runs))
    decode = pd.concat(runs.values(), ignore_index=True).dropna(subset=["decode"])
    for (policy, load), d in decode.groupby(["policy", decode.load.fillna("-")]):
        lines.append(f"  decode steps' real / price, {policy:8s} {load:5s} {len(d):4d} runs: mean {d.decode.mean():.4f}"
                     f", median {d.decode.median():.4f}, {d.decode.min():.3f}-{d.decode.max():.3f}")
    by_policy = pd.concat({Path(v).name: r for v, r in runs.items()}, names=["validation"]).reset_index(level=0)
    by_policy = by_policy.groupby(["validation", "policy"]).prefill.mean().unstack()
    lines.append("  each validation's prompt steps (prefill, chunk, fused) real / price, its runs' mean by policy: "
                 "a GPU's own prefill speed")
    lines.append(f"    {'':34s}" + "".join(f"{policy:>9s}" for policy in by_policy.columns))
    lines += [f"    {v:34s}" + "".join(f"{x:9.3f}" if x == x else f"{'-':>9s}" for x in row)
              for v, row in by_policy.iterrows()]
    lines.append(_kinds_together(runs))
    lines += [line for load in (("all", "near", "past") if bands else ())
              if (line := band_line(load, [b[load] for b in bands.values()]))]
    return "\n".join(lines)


def _kinds_together(runs: dict[Path, pd.DataFrame]) -> str:
    """How a GPU's decode and prompt speeds spread and move together over validations (each its runs' mean log
    speed): the bands draw every kind of step with one z, as if they moved together (servecap/sim/intervals.py)."""
    speeds = pd.DataFrame({v: {k: np.log(r[k]).mean() for k in ("decode", "prefill")} for v, r in runs.items()}).T
    speeds = speeds.dropna()
    if len(speeds) < 3:
        return f"  decode and prompt steps' mean speeds by validation: {len(speeds)} with both, too few to spread"
    sd = speeds.std(ddof=1)
    return (f"  decode and prompt steps' mean log speeds over {len(speeds)} validations: sd {sd.decode:.2%} and "
            f"{sd.prefill:.2%}, correlation {np.corrcoef(speeds.decode, speeds.prefill)[0, 1]:+.2f}")


def band_line(load: str, covs: list[dict]) -> str | None:
    """The bands at one load (`all`, `near`, `past`) over one or several validations' coverages: how many
    measurements fall inside, and how many bands are within twice their repeats' spread; None if none is graded."""
    inside, graded = sum(c["inside"] for c in covs), sum(c["graded"] for c in covs)
    ratios = [w["width"] / w["real_spread"] for c in covs for w in c["width_vs_real_spread"]]
    return None if not graded else f"  90% bands, {load} points: {inside} of {graded} inside ({inside / graded:.1%})" + (
        f"; width within 2x the repeats' spread {sum(r <= 2 for r in ratios)} of {len(ratios)} (median "
        f"{statistics.median(ratios):.1f}x)" if ratios else "")


def _guessed_speeds(runs: dict[Path, pd.DataFrame]) -> str:
    """How well a point's mean speed (its runs' mean log summed real / price) is told by the other points of its
    validation (one GPU's session), by those of its policy alone, or by nothing (1.000): whether a session-level or
    a per-policy refresh of the table could narrow what a band's cost sigma has to cover."""
    errors = {"session": [], "policy": [], "none": []}
    for r in runs.values():
        speed = r.assign(log=np.log(r.total)).groupby(["point", "policy"]).log.mean().reset_index()
        for i, p in speed.iterrows():
            others = speed.drop(index=i)
            same = others[others.policy == p.policy]
            errors["none"].append(p.log)
            if len(others):
                errors["session"].append(p.log - others.log.mean())
            if len(same):
                errors["policy"].append(p.log - same.log.mean())
    rms = {k: f"{np.sqrt(np.mean(np.square(v))):.2%} ({len(v)} points)" if v else "-" for k, v in errors.items()}
    return (f"  a point's mean speed told by the other points of its validation: RMS of the log error {rms['session']}; "
            f"by those of its policy alone {rms['policy']}; by none (1.000) {rms['none']}")


def _read_first(runs: dict[Path, pd.DataFrame], n: int = 2) -> str:
    """How well the speed of a validation's first N points run (by their first run's start) tells its other points':
    what a table rescaled to a GPU's own first runs reads (`calibrate --from-runs --rescale`, validations v40-v42)."""
    errors = []
    for r in runs.values():
        if "started" not in r or r.started.isna().any() or r.point.nunique() <= n:
            continue
        first = r.groupby("point").started.min().sort_values().index[:n]  # ISO times: their order is time's
        log = np.log(r.total)
        read = log[r.point.isin(first)].mean()
        errors += (log[~r.point.isin(first)] - read).groupby(r.point).mean().tolist()
    rms = f"{np.sqrt(np.mean(np.square(errors))):.2%} ({len(errors)} points)" if errors else "-"
    return (f"  a point's mean speed told by the first {n} points run on its GPU (their runs' mean): RMS of the log "
            f"error {rms}")


def _sampled(steps, telemetry) -> dict:
    """The SM clock and temperature last sampled before each step's start (NaN without telemetry), in columns of their
    own: priced_steps' clock_mhz would price the step at its clock, and the grading prices at the reference."""
    joined = join_steps(steps[["start"]], telemetry)
    return {"sampled_clock_mhz": joined.sm_clock_mhz.to_numpy(), "temperature_c": joined.temperature_c.to_numpy()}


def replan(validation: Path, table: Path, out: Path) -> tuple[Path, Path]:
    """`validation`'s points and traces planned from `table` with 90% bands into `out`, for grade's `replanned`."""
    make_plan(table, out, points_from=validation, interval=90.0, force=True)
    return out, table


def against(validation: Path, plan_dir: Path) -> tuple[Path, Path]:
    """The committed plan in `plan_dir` and its table, for grade's `replanned`, once it is known to plan every point
    of `validation`'s."""
    try:
        plan = json.loads((plan_dir / "plan.json").read_text())
    except (OSError, ValueError):
        raise InputError("holds no readable plan.json", path=plan_dir) from None
    own = json.loads((validation / "plan.json").read_text())["predictions"]
    missing = sorted(set(own) - set(plan["predictions"]))
    if missing:
        raise InputError(f"does not plan {len(missing)} of {validation}'s points ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''})", path=plan_dir)
    return plan_dir, Path(plan["table"]["path"])


def unrefreshed(validation: Path) -> tuple[Path, Path] | None:
    """For a validation planned from a refreshed table, the committed plan its points came from (`points_from`, made
    from the table the refresh started from) and that table, for grade's `replanned`; None for one planned from a
    table as it is."""
    plan = json.loads((validation / "plan.json").read_text())
    refreshed_from = json.loads(Path(plan["table"]["path"]).read_text()).get("refreshed_from")
    if not refreshed_from:
        return None
    source = (plan.get("points_from") or {}).get("dir")
    if source is None or (Path(source) / "plan.json").is_file() and json.loads(
            (Path(source) / "plan.json").read_text())["table"]["id"] != refreshed_from["table_id"]:
        raise InputError(f"was planned from a table refreshed from {refreshed_from['table_id']}, and no plan of its "
                         f"points from that table is recorded (points_from: {source})", path=validation)
    return against(validation, Path(source))


def shared_band_ratios(graded: dict[Path, tuple[list, dict]]) -> dict[str, tuple[int, list[float]]]:
    """Where several validations ran a point under one band (a plan copied to several GPUs: the same point id and
    band), near and past capacity: how many such points, and each band's width over the spread of every GPU's runs
    there (what the band holds that one GPU's repeats do not show, the GPU-to-GPU speed)."""
    shared: dict[tuple[str, str], tuple[dict, list]] = {}
    for results, bands in graded.values():
        for c in results:
            if c.real and c.point.id in bands:
                band = bands[c.point.id]
                shared.setdefault((c.point.id, json.dumps(band, sort_keys=True)), (band, []))[1].append(c)
    merged = [(replace(cs[0], real=[r for c in cs for r in c.real]), band)
              for band, cs in shared.values() if len(cs) > 1]
    out = {}
    for load in ("near", "past"):
        at = [(c, band) for c, band in merged if c.point.load == load]
        out[load] = (len(at), [w["width"] / w["real_spread"] for c, band in at
                               for w in coverage([c], {c.point.id: band})["width_vs_real_spread"]])
    return out


def across_gpus(graded: dict[Path, tuple[list, dict]]) -> list[str]:
    """shared_band_ratios' bands near and past capacity against the spread of every GPU's runs, a line each."""
    return [f"  90% bands, {load} points run on several GPUs ({n}): width within 2x the spread of every GPU's runs "
            f"{sum(r <= 2 for r in ratios)} of {len(ratios)} (median {statistics.median(ratios):.1f}x)"
            for load, (n, ratios) in shared_band_ratios(graded).items() if ratios]


def grade_all(validations: list[Path], plan_of=lambda v: None, by: str | None = None,
              segments: bool = False) -> dict[Path, Graded]:
    """Grade each validation (grade) against the plan `plan_of` gives it (grade's `replanned`; None: its own) and,
    given several, print what they pool to."""
    for v in validations:
        if not (v / "plan.json").is_file():
            raise InputError("holds no plan.json", path=v)
    graded = {v: grade(v, by, plan_of(v), segments=segments) for v in validations}
    if len(graded) > 1:
        print("\n".join([targets_line(graded), pooled({v: g.runs for v, g in graded.items()},
                                                        {v: g.bands for v, g in graded.items()}),
                         *across_gpus({v: g.compared for v, g in graded.items()})]))
    return graded


@command("grade_validation")
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("validations", type=Path, nargs="+")
    p.add_argument("--by", choices=sorted(BINS), help="also bin every run's steps' real / price by this context")
    p.add_argument("--segments", action="store_true", help="also each run's real / price by its share of time")
    p.add_argument("--replan", type=Path, metavar="TABLE", help="grade against a plan re-made from this table "
                   "(retrospective)")
    p.add_argument("--work", type=Path, help="with --replan: where its plans go (default: a temporary directory of "
                   "this run's own, removed after)")
    p.add_argument("--against", type=Path, metavar="PLAN_DIR", help="grade against this committed plan of the same "
                   "points, on its own table (e.g. the unrefreshed plan a refreshed one was made from)")
    p.add_argument("--unrefreshed", action="store_true", help="grade each validation planned from a refreshed table "
                   "against the committed plan its points came from, made from the table the refresh started from "
                   "(its plan's points_from), the others against their own: the tables as they are, over sessions "
                   "refreshed or not")
    args = p.parse_args(argv)
    if sum(map(bool, (args.against, args.replan, args.unrefreshed))) > 1:
        p.error("--against, --replan and --unrefreshed are different plans: give one")
    warnings.simplefilter("ignore")  # extrapolation notes about a few long steps; the grading reads every step
    # --replan without --work: a scratch directory of this run's own, so that two replans at once never grade
    # against each other's plans
    scratch = tempfile.TemporaryDirectory(prefix="grade-replan-") if args.replan and not args.work else \
        contextlib.nullcontext(args.work)
    with scratch as work:
        return _graded(args, Path(work) if work else None)


def _graded(args: argparse.Namespace, work: Path | None) -> int:
    plan_of = (lambda v: against(v, args.against)) if args.against else unrefreshed if args.unrefreshed else \
        (lambda v: None) if args.replan is None else (lambda v: replan(v, args.replan, work / v.name))
    grade_all(args.validations, plan_of, args.by, args.segments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
