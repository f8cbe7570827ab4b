"""The simulator's records, bit for bit, against those the first version made on the same inputs.

tests/data/sim_golden.json holds digests of the requests, steps and token times that version 1 of the simulator
(before the one step loop, the costs package and the speed work) wrote for these five runs on the first shipped
H200 table (tests/data/h200-v1-59e02847ee9daee8.json, a version-1 table: it also shows old tables still read).
Any change to a decision or an addition order shows here as a different digest.

tests/data/sim_golden_v2.json holds the same digests, and the summary figures, for what version 1 could not run
(packed and chunked prefill, fleets behind routers), as the simulator wrote them before the second round of speed
work (commit 42c7072): that work changed how fast the records are made, not what they hold.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from servecap.costs.model import CostModel
from servecap.costs.table import StationarityWarning, load_cost_table
from helpers import sim_config
from servecap.sim.fleet import simulate_fleet
from servecap.sim.simulator import simulate
from servecap.traces.metrics import summary
from servecap.traces.workload import closed_mixed, length_trace, poisson_trace

DATA = Path(__file__).resolve().parent / "data"
REQUESTS = ("request_id", "arrival", "admitted", "admit_step", "group_id", "group_size", "first_token", "finished",
            "prompt_tokens", "output_tokens", "blocks")
STEPS = ("step", "kind", "rows", "padded_len", "prompt_tokens", "kv_tokens", "kv_max", "kv_read", "start", "end",
         "group_id", "n_admitted", "retired")  # n_admitted: `admitted` when the digests were made


def _arbitrary() -> list[tuple[float, int, int]]:
    rng = np.random.default_rng(7)
    return [(float(a), int(p), int(b)) for a, p, b in zip(np.cumsum(rng.exponential(1 / 25, 300)),
                                                          rng.integers(1, 4097, 300), rng.integers(1, 257, 300))]


CASES = {
    "paged32-rate30": (lambda: poisson_trace(30, 400, 0), dict(backend="paged", max_batch=32)),
    "padded16-0.5gib-rate20-seed1": (lambda: poisson_trace(20, 400, 1),
                                     dict(backend="dense", max_batch=16, pool_gib=0.5)),
    "paged32-1gib-rate60-noise3": (lambda: poisson_trace(60, 400, 2),
                                   dict(backend="paged", max_batch=32, pool_gib=1, noise_seed=3)),
    "closed-mixed-64-through-8": (lambda: closed_mixed(64, 0), dict(backend="paged", max_batch=8)),
    "arbitrary-lengths-rate25": (lambda: length_trace(_arbitrary()), dict(backend="paged", max_batch=32)),
}


def _digest(df, cols) -> str:
    h = hashlib.sha256()
    for row in df[list(cols)].itertuples(index=False, name=None):
        h.update(repr(tuple(float(x) if not isinstance(x, str) else x for x in row)).encode())
    return h.hexdigest()[:20]


def _digests(rec, extra: tuple[str, ...] = ()) -> dict:
    """The record's requests, steps and token times as digests (with the `extra` columns), and its step count. A
    fleet's steps are taken replica by replica: each replica writes its own in step order, but how the replicas'
    writes interleave is the event loop's order, not the record's content."""
    steps = rec.steps.sort_values("replica", kind="stable") if "replica" in extra else rec.steps
    return {"requests": _digest(rec.requests, REQUESTS + extra), "steps": _digest(steps, STEPS + extra),
            "tokens": _digest(rec.tokens, ("request_id", "index", "time")), "n_steps": len(rec.steps)}


@pytest.fixture(scope="module")
def cost() -> CostModel:
    with pytest.warns(StationarityWarning, match="no stationarity check"):
        return CostModel(load_cost_table(DATA / "h200-v1-59e02847ee9daee8.json"))


@pytest.mark.parametrize("name", list(CASES))
def test_records_are_bit_identical_to_the_first_simulator(cost, name):
    want = json.loads((DATA / "sim_golden.json").read_text())[name]
    make, cfg = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation notices of the old table
        rec = simulate(make(), cost, sim_config(detail="tokens", **cfg)).record
    got = {**_digests(rec), "finished_last": float(rec.requests.finished.max())}
    assert got == want


CASES_V2 = {
    "packed-paged32-rate30": (1, "round-robin", dict(backend="paged", max_batch=32, prefill="packed")),
    "chunked256-padded16-0.5gib-rate30": (1, "round-robin", dict(backend="dense", max_batch=16,
                                                                pool_gib=0.5, prefill="chunked:256")),
    "fleet3-least-tokens-rate60-noise3": (3, "least-tokens", dict(backend="paged", max_batch=16, noise_seed=3)),
}


@pytest.mark.parametrize("name", list(CASES_V2))
def test_policies_and_fleets_write_the_records_they_wrote_before(cost, name):
    want = json.loads((DATA / "sim_golden_v2.json").read_text())[name]
    replicas, router, cfg = CASES_V2[name]
    rate = 60 if replicas > 1 else 30
    trace, cfg = poisson_trace(rate, 400, 3), sim_config(detail="tokens", replicas=replicas, router=router, **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation and derived-cost notices of the old table
        result = simulate(trace, cost, cfg) if replicas == 1 else simulate_fleet(trace, cost, cfg)
    rec = result.record
    got = {**_digests(rec, ("replica",)), "summary": repr(summary(rec, rate))}
    assert got == want
