"""A validation plan's points: what each one runs, where its real records live, and the helpers every reader of
them shares (which repeats are complete, the relative error of a prediction)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from traces.errors import InputError
from traces.records import RunRecord, read_run
from traces.trace_io import read_trace
from traces.workload import Trace, closed_mixed, closed_uniform, poisson_trace, synthetic_trace

ABS_FLOOR = {"queue_wait_p50": 0.02}  # seconds: below this a relative error of a near-zero wait means little


@dataclass
class Point:
    id: str
    role: str  # below / near / past (the capacity curve), small-pool, backend, closed, public, policy, sag
    trace: dict  # how to rebuild the trace: poisson / closed-mixed / closed-uniform / file
    backend: str = "paged"
    max_batch: int = 32
    pool_gib: float | None = None  # None: the engine's own (large) pool
    warmup: int = 0
    repeats: int = 1
    tokens: bool = False  # record every token's time (the closed controls, for the inter-token gaps)
    prefill: str = "padded"
    fresh: bool = False  # run on a freshly started engine (the first pass of its trace)
    replicas: int = 1  # more than one: a fleet behind `router` (engine/fleet.py; sim/fleet.py predicts it)
    router: str = "round-robin"


def build_trace(spec: dict, root: Path) -> Trace:
    kind = spec["kind"]
    if kind in ("poisson", "gamma"):
        return poisson_trace(spec["rate"], spec["n"], spec["seed"], spec.get("burstiness", 1.0),
                             spec.get("ramp_up_s", 0.0))
    if kind == "closed-mixed":
        return closed_mixed(spec["n"], spec["seed"])
    if kind == "closed-uniform":
        return closed_uniform(spec["prompt"], spec["n"], spec["budget"])
    if kind == "synthetic":
        return synthetic_trace(spec["rate"], spec["n"], spec["seed"], spec["prompts"], spec["budgets"])
    if kind == "file":
        return read_trace(root / spec["path"])
    raise InputError(f"unknown trace kind {kind!r} in the validation plan")


def load_plan(out: Path) -> tuple[dict, list[Point]]:
    path = Path(out) / "plan.json"
    if not path.exists():
        raise InputError("no validation plan here; make one with `python -m validate plan`", path=path)
    plan = json.loads(path.read_text())
    return plan, [Point(**p) for p in plan["points"]]


def run_dir(out: Path, p: Point, k: int) -> Path:
    return Path(out) / "real" / p.id / f"run-{k}"


def is_complete(d: Path) -> bool:
    meta = Path(d) / "meta.json"
    return meta.exists() and json.loads(meta.read_text()).get("status") == "complete"


def complete_runs(out: Path, p: Point) -> list[RunRecord]:
    """The point's real repeats whose records are complete, in repeat order."""
    return [read_run(run_dir(out, p, k)) for k in range(1, p.repeats + 1) if is_complete(run_dir(out, p, k))]


def rel_error(pred: float, meas: float, key: str = "") -> float:
    """(predicted - measured) / measured; near-zero waits are judged against an absolute floor (ABS_FLOOR)."""
    if not (math.isfinite(pred) and math.isfinite(meas)):
        return math.nan
    return (pred - meas) / max(abs(meas), ABS_FLOOR.get(key, 1e-9))
