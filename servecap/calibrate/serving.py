"""The calibration's serving phase (`python -m calibrate --out T --serving T2`): seeded arrival traces served by the
engine just calibrated, each prefill policy at three loads (below, near and past the capacity the new table
predicts for it), and T corrected from those runs' steps into T2 (servecap/calibrate/from_runs.py, held out by
run: each policy's near-capacity run).

Closed runs time a step on its own; serving adds the context around it (the step before it, an idle gap, the first
step of a decode stretch, which pays its pass's host work), and this phase measures that before any validation
sees the table. Its traces are synthetic (prompts log-uniform over 16..4096 tokens, budgets uniform over 1..256,
seeds of their own), so a table corrected here knows nothing of the traffic a validation replays.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from servecap.core.config import ServingConfig
from servecap.costs.model import CostModel
from servecap.costs.table import load_cost_table
from servecap.traces.records import is_complete
from servecap.traces.workload import Request, Trace, at_rate, synthetic_trace

if TYPE_CHECKING:
    from servecap.engine.engine import EngineConfig

# (name, share of the predicted capacity); names sort so that from_runs.split holds out each policy's third run,
# the near-capacity one, where a table's error matters most.
LOADS = (("1-below", 0.6), ("2-past", 1.2), ("3-near", 0.9))
PROBE_LOADS = (("near", 0.9),)  # a refresh's serving probe (calibrate --refresh --serving-probe): where TTFT is decided
REQUESTS = 240  # a run of about 6-12 s on an H200 at these loads
QUICK_REQUESTS = 8  # calibrate --quick's smoke test of the path
PROMPTS, BUDGETS = "loguniform", "uniform"
SEED = 9001  # no validation plans this seed (they use 0 and the public traces)
SATURATED_RATE = 1e6  # requests a second: everything arrives within a millisecond


@dataclass(frozen=True)
class ServingRun:
    name: str  # the run's directory under the phase's folder
    policy: str
    trace: Trace


def clipped(trace: Trace, engine: EngineConfig) -> Trace:
    """The trace with its requests' lengths clipped to what `engine` serves."""
    reqs = [Request(r.request_id, r.arrival, min(r.prompt_tokens, engine.max_prompt), min(r.budget, engine.max_budget))
            for r in trace.requests]
    return Trace(reqs, {**trace.meta, "max_prompt": engine.max_prompt, "max_budget": engine.max_budget})


def workload(rate: float, n: int, seed: int, engine: EngineConfig) -> Trace:
    """The phase's trace at `rate`: n synthetic requests, their lengths clipped to what `engine` serves."""
    return clipped(synthetic_trace(rate, n, seed, PROMPTS, BUDGETS), engine)


def capacity(cost: CostModel, serving: ServingConfig, saturated: Trace) -> float:
    """The policy's saturated served rate on a trace offered at once, simulated on `cost`."""
    from servecap.sim.simulator import SimConfig, simulate
    from servecap.traces.metrics import served_rate

    return served_rate(simulate(saturated, cost, SimConfig(serving, detail="summary")).record)


def serving_runs(table_path: Path, policies: list[str], backend: str, engine: EngineConfig,
                 n: int = REQUESTS, loads: tuple[tuple[str, float], ...] = LOADS,
                 traces: dict[str, Trace] | None = None) -> list[ServingRun]:
    """The phase's runs of n requests, each policy at `loads` of its capacity on the table at `table_path`, lengths
    clipped to what `engine` serves: synthetic, a seed per run, or with `traces` (name -> trace) the first n
    requests of each, its time scaled to each load."""
    cost = CostModel(load_cost_table(table_path, allow_nonstationary=True))
    runs = []
    for i, policy in enumerate(policies):
        serving = engine.serving.but(backend=backend, prefill=policy)
        tag = policy.replace(":", "")
        if traces is None:
            seed = SEED + 10 * i
            top = capacity(cost, serving, workload(SATURATED_RATE, n, seed, engine))
            runs += [ServingRun(f"{tag}-{name}", policy, workload(round(share * top, 2), n, seed + j, engine))
                     for j, (name, share) in enumerate(loads)]
            continue
        for trace_name, trace in traces.items():
            base = clipped(Trace(trace.requests[:n], trace.meta), engine)
            top = capacity(cost, serving, at_rate(base, SATURATED_RATE))
            runs += [ServingRun(f"{tag}-{trace_name}-{name}", policy, at_rate(base, round(share * top, 2)))
                     for name, share in loads]
    return runs


def kept(d: Path, run: ServingRun, uuid: str | None) -> bool:
    """Whether folder d holds this run already: a complete record of the same trace on the same GPU (a record left
    by a run for another table, whose capacity scaled the trace otherwise, or on another GPU, is made again)."""
    if not is_complete(d):
        return False
    meta = json.loads((d / "meta.json").read_text())
    return meta.get("trace_id") == run.trace.trace_id and (meta.get("device") or {}).get("uuid") == uuid


def serve_runs(engine, runs: list[ServingRun], folder: Path, backend: str, progress=None) -> list[Path]:
    """Serve each run on `engine` into folder/NAME (a record this run made is kept, any other made again: kept);
    returns the runs' directories."""
    dirs = []
    uuid = engine.metadata()["device"].get("uuid")
    for run in runs:
        d = folder / run.name
        if not kept(d, run, uuid):
            if d.exists():
                shutil.rmtree(d)
            engine.run(run.trace, d, backend, tokens=False, policy=run.policy, progress=False,
                       extra_meta={"calibration_serving": {"run": run.name, "trace": run.trace.meta}})
        dirs.append(d)
        if progress:
            progress(run)
    return dirs
