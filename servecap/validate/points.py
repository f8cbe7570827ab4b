"""A validation plan's points: what each one runs, where its real records live, and the helpers every reader of
them shares (which repeats are complete, the relative error of a prediction)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.traces.csvio import read_text
from servecap.traces.errors import InputError
from servecap.traces.records import RunRecord, is_complete, read_run
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import Trace, closed_mixed, closed_uniform, poisson_trace, synthetic_trace

ABS_FLOOR = {"queue_wait_p50": 0.02}  # seconds: below this a relative error of a near-zero wait means little


@dataclass
class Point:
    """A planned point: what it serves (`serving`: an unbounded pool stands for the engine's own large one; more
    than one replica is a fleet, servecap/engine/fleet.py, that servecap/sim/fleet.py predicts) and how the real runs go."""

    id: str
    role: str  # below / near / past (the capacity curve), small-pool, backend, closed, public, policy, sag
    trace: dict  # how to rebuild the trace: poisson / closed-mixed / closed-uniform / file
    serving: ServingConfig = ServingConfig()
    warmup: int = 0
    repeats: int = 1
    tokens: bool = False  # record every token's time (the closed controls, for the inter-token gaps)
    fresh: bool = False  # run on a freshly started engine (the first pass of its trace)

    @classmethod
    def from_json(cls, d: dict) -> "Point":
        """A point as plan.json holds it: the serving knobs flat beside the others."""
        d = dict(d)
        serving = {k: d.pop(k) for k in SERVING_KEYS if k in d}
        serving["pool"] = PoolSize(gib=serving.pop("pool_gib", None))
        return cls(**d, serving=ServingConfig(**serving))

    @property
    def load(self) -> str | None:
        """below / near / past capacity: the capacity curve's role, or the word the plan put in a public or
        mechanism point's id (None: a closed control, a fleet or a sag point)."""
        if self.role in LOADS:
            return self.role
        return next((w for w in LOADS if f"-{w}-" in f"-{self.id}-"), None)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "serving"}
        return {**d, **{k: v for k, v in self.serving.axes().items() if k in SERVING_KEYS}}


LOADS = ("below", "near", "past")
# plan.json's names (a plan made before admission, prefix_cache or the step cap were knobs has none: the defaults)
SERVING_KEYS = ("backend", "max_batch", "pool_gib", "prefill", "admission", "prefix_cache", "max_num_batched_tokens",
                "replicas", "router")


def round_rate(x: float) -> float:
    """A planned rate, to two significant figures (a point's id names it)."""
    return float(f"{x:.2g}")


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
    try:
        plan = json.loads(read_text(path))
    except (json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"is not valid JSON ({e}); make the plan again with `python -m validate plan`",
                         path=path) from None
    if not (isinstance(plan, dict) and isinstance(plan.get("table"), dict) and "id" in plan["table"]
            and isinstance(plan.get("points"), list) and isinstance(plan.get("predictions"), dict)):
        raise InputError("is not a validation plan (a JSON object with its table's id, points and predictions); "
                         "make one with `python -m validate plan`", path=path)
    points = []
    for i, entry in enumerate(plan["points"], start=1):
        try:
            points.append(Point.from_json(entry))
        except (TypeError, ValueError) as e:  # not an object, or not a point's fields
            raise InputError(f"point {i} is not a validation point ({e})", path=path) from None
        except InputError as e:  # a serving knob out of range
            raise InputError(f"point {i}: {e}", path=path) from None
    unpredicted = [p.id for p in points if p.id not in plan["predictions"]]
    if unpredicted:
        raise InputError(f"has no prediction for point(s) {', '.join(unpredicted)}", path=path)
    return plan, points


def _unrated(point_id: str) -> str:
    """A point's id without the rate its name ends with (azure-conv-near-37 -> azure-conv-near), as one names it
    before the plan has chosen the rate."""
    head, _, tail = point_id.rpartition("-")
    return head if head and tail.replace(".", "", 1).isdigit() else point_id


def select(points: list[Point], only: list[str]) -> tuple[list[Point], list[str]]:
    """The points `only` names, each by its id with or without its rate, and the ids of the others; a name that
    matches none is refused, before anything runs."""
    names = {p.id: {p.id, _unrated(p.id)} for p in points}
    unknown = [n for n in only if not any(n in ids for ids in names.values())]
    if unknown:
        raise InputError(f"--only names point(s) the plan does not have: {', '.join(unknown)} (it has "
                         f"{', '.join(p.id for p in points)})")
    return [p for p in points if names[p.id] & set(only)], [p.id for p in points if not names[p.id] & set(only)]


def run_dir(out: Path, p: Point, k: int) -> Path:
    return Path(out) / "real" / p.id / f"run-{k}"


def complete_dirs(out: Path, p: Point) -> list[Path]:
    """The directories of the point's real repeats whose records are complete, in repeat order (an interrupted
    repeat's record is left where it is, and skipped)."""
    return [d for d in (run_dir(out, p, k) for k in range(1, p.repeats + 1)) if is_complete(d)]


def complete_runs(out: Path, p: Point) -> list[RunRecord]:
    """The point's real repeats whose records are complete, in repeat order."""
    return [read_run(d) for d in complete_dirs(out, p)]


def rel_error(pred: float, meas: float, key: str = "") -> float:
    """(predicted - measured) / measured; near-zero waits are judged against an absolute floor (ABS_FLOOR)."""
    if not (math.isfinite(pred) and math.isfinite(meas)):
        return math.nan
    return (pred - meas) / max(abs(meas), ABS_FLOOR.get(key, 1e-9))
