"""`validate replay`: every complete real run of a validation replayed through the simulator's scheduler with its own
recorded step times (servecap/sim/replay.py), one line a run, in replay.md and replay.json.

A run the replay reproduces (every step as the engine ran it, every request's times within a microsecond) says the
simulator's scheduling is the engine's; what its prediction still misses there is the step costs alone. Fleet
points are left out (a replay takes one engine's record).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pandas as pd

from servecap.sim.replay import SAME_S, TIMES, replay
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.provenance import provenance
from servecap.traces.records import read_run

from .noise import runs_by_point
from .points import build_trace, load_plan, select

FILES = ("replay.md", "replay.json")


def replay_runs(out: Path, only: list[str] | None = None,
                progress: Callable[[str], None] = lambda _: None) -> pd.DataFrame:
    """A row per complete run of the plan's single-engine points (those named in `only`, by id with or without
    its rate, where given)."""
    out = Path(out)
    points = load_plan(out)[1]
    points = {p.id: p for p in (select(points, only)[0] if only else points)}
    rows = []
    for pid, runs in runs_by_point(out, min_runs=1).items():
        p = points.get(pid)
        if p is None or p.serving.replicas > 1:
            continue
        trace = build_trace(p.trace, out)
        for run in runs:
            r = replay(read_run(run), trace, run, out / p.trace.get("path", "plan.json"))
            real, replayed = r.ttft_p50()
            d = r.divergence
            rows.append({"point": pid, "run": run.name, "identical": r.identical, "steps_used": r.used,
                         "steps_recorded": r.recorded, **{f"max_error_ms_{c}": 1e3 * r.error_s(c) for c in TIMES},
                         "ttft_p50_ms": 1e3 * real, "ttft_p50_replayed_ms": 1e3 * replayed,
                         "diverged_at_step": None if d is None else d.index,
                         "diverged_at_s": None if d is None else d.start,
                         "engine_ran": None if d is None else d.recorded,
                         "scheduler_asked": None if d is None else d.asked})
            progress(f"{pid} {run.name}: " + ("identical" if r.identical else
                                              f"not identical: step {d.index}, the engine ran {d.recorded}, the "
                                              f"scheduler asked for {d.asked}" if d else "not identical: times differ"))
    if not rows:
        raise InputError("has no complete real run of a single-engine point to replay", path=out / "real")
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame, out: Path) -> str:
    n, same = len(df), int(df.identical.sum())
    lines = [f"# Replay of the real runs through the simulator's scheduler: {out}", "",
             "Each run's steps, with the times the engine's took, through the simulator's scheduler and step loop "
             "(`python -m validate replay`, servecap/sim/replay.py). Identical: every step as the engine ran it and "
             f"every request's admission, first token and finish within {SAME_S * 1e6:g} us of the record's.", "",
             f"{same} of {n} runs identical.", "",
             "| point | run | identical | steps | max error, admitted / first token / finished (ms) | "
             "TTFT p50 real / replayed (ms) | first divergence |", "|---|---|---|---|---|---|---|"]
    for r in df.itertuples():
        err = " / ".join("-" if math.isnan(getattr(r, f"max_error_ms_{c}")) else
                         f"{getattr(r, f'max_error_ms_{c}'):.3f}" for c in TIMES)
        div = "" if pd.isna(r.engine_ran) else (
            f"step {r.diverged_at_step} at {r.diverged_at_s:.3f} s: engine ran {r.engine_ran}, "
            f"scheduler asked {r.scheduler_asked}")
        lines.append(f"| {r.point} | {r.run} | {'yes' if r.identical else 'no'} | {r.steps_used} of "
                     f"{r.steps_recorded} | {err} | {r.ttft_p50_ms:.1f} / {r.ttft_p50_replayed_ms:.1f} | {div} |")
    return "\n".join(lines) + "\n"


def write(out: Path, only: list[str] | None = None, force: bool = False,
          progress: Callable[[str], None] = lambda _: None) -> tuple[Path, int, int]:
    """replay.md and replay.json in the validation directory; (replay.md, identical runs, runs)."""
    out = Path(out)
    there = [f for f in FILES if (out / f).exists()]
    if there and not force:
        raise InputError(f"already holds {', '.join(there)}; pass --force to replay again", path=out)
    df = replay_runs(out, only, progress)
    doc = {"runs": len(df), "identical": int(df.identical.sum()), "same_s": SAME_S,
           "rows": json.loads(df.to_json(orient="records")), **provenance()}
    atomic_write_text(out / "replay.json", json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out / "replay.md", markdown(df, out))
    return out / "replay.md", int(df.identical.sum()), len(df)
