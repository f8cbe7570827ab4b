"""Fleets in the simulator: hand-computed routing and timing, a fleet of one against simulate(), per-replica scores.

Hand-computed cases use constant costs (prefill 0.1 s, decode step 0.01 s, no retire overhead), so every time is a
sum written out in a comment; the expected values are those sums in the simulator's order of addition, so the
comparisons are exact.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pandas as pd
import pytest
from helpers import constant_table, linear_table, sim_config

from servecap.costs.model import CostModel
from servecap.costs.table import load_cost_table
from servecap.core.routing import ROUTERS
from servecap.sim import simulate
from servecap.sim.fleet import simulate_fleet
from servecap.traces import metrics
from servecap.traces.errors import InputError
from servecap.traces.workload import Request, Trace, closed_mixed, closed_uniform, length_trace, poisson_trace


def after(start: float, *costs: float) -> float:
    """`start` plus each step's cost in turn: the simulator's own order of addition."""
    for c in costs:
        start += c
    return start


DECODE = 0.01


def fleet(triples, router="round-robin", replicas=2, table=None, **cfg):
    """Simulate (arrival, prompt tokens, budget) triples on a fleet; the requests frame indexed by request id."""
    result = simulate_fleet(length_trace(triples), CostModel(table or constant_table()),
                            sim_config(detail="tokens", replicas=replicas, router=router, **cfg))
    return result.record.requests.set_index("request_id").sort_index(), result


def test_round_robin_by_hand():
    # r0 at 0 (budget 3) -> replica 0, r1 at 0.05 (budget 2) -> replica 1, r2 at 0.08 (budget 2) -> replica 0.
    # Replica 0: r0 admitted at 0, prefill -> 0.1, one decode step -> 0.11 (the stretch stops at the first step
    # ending after the router's next arrival); r2, pushed at 0.08, is admitted at 0.11: prefill -> 0.21, decode of
    # r0 and r2 -> 0.22, both done. Replica 1: r1 wakes it at 0.05: prefill -> 0.15, decode -> 0.16.
    req, result = fleet([(0.0, 16, 3), (0.05, 16, 2), (0.08, 16, 2)])
    assert list(req["replica"]) == [0, 1, 0]
    assert list(req["admitted"]) == [0.0, 0.05, 0.1 + 0.01]
    assert list(req["first_token"]) == [0.1, 0.05 + 0.1, 0.1 + 0.01 + 0.1]
    assert list(req["finished"]) == [0.1 + 0.01 + 0.1 + 0.01, 0.05 + 0.1 + 0.01, 0.1 + 0.01 + 0.1 + 0.01]
    # Group ids and steps count per replica: each replica is its own engine.
    assert list(req["group_id"]) == [0, 0, 1] and list(req["admit_step"]) == [0, 0, 1]
    steps = result.record.steps
    assert steps.groupby("replica")["kind"].apply(list).to_dict() == {
        0: ["prefill", "decode", "prefill", "decode"], 1: ["prefill", "decode"]}
    assert result.record.meta["replicas"] == 2 and result.record.meta["router"] == "round-robin"


TO_THE_IDLE_ONE = [(0.0, 16, 10), (0.01, 16, 2), (0.155, 16, 2)]


def test_least_outstanding_sends_the_third_request_to_the_idle_replica():
    # r0 (budget 10) -> replica 0 (a tie goes to the lowest index); r1 (budget 2) -> replica 1, which has none.
    # Replica 1: prefill 0.01 -> 0.11, decode -> 0.12, r1 retired: idle again. At 0.155 replica 0 still runs r0
    # (prefill -> 0.1, nine decode steps -> 0.19), so r2 goes to replica 1: prefill -> 0.255, decode -> 0.265.
    req, _ = fleet(TO_THE_IDLE_ONE, "least-outstanding")
    assert list(req["replica"]) == [0, 1, 1]
    assert list(req["admitted"]) == [0.0, 0.01, 0.155]
    assert list(req["finished"]) == [after(0.1, *[DECODE] * 9), 0.01 + 0.1 + 0.01, 0.155 + 0.1 + 0.01]
    # Round-robin sends r2 to replica 0 whatever it holds: r2 waits for the end of r0's step that ends after
    # 0.155, at 0.1 + 6 x 0.01 = 0.16, and r0 pauses for r2's prefill (-> 0.26), so both finish later.
    req, _ = fleet(TO_THE_IDLE_ONE, "round-robin")
    assert list(req["replica"]) == [0, 1, 0]
    admitted = after(0.1, *[DECODE] * 6)
    assert req.loc[2, "admitted"] == admitted and req.loc[2, "finished"] == admitted + 0.1 + 0.01
    assert req.loc[0, "finished"] == after(admitted, 0.1, DECODE, DECODE, DECODE)  # 7 tokens by 0.16, then 8, 9, 10


BY_TOKENS = [(0.0, 1000, 100), (0.01, 16, 100), (0.05, 16, 2)]


def test_least_tokens_weighs_prompt_and_budget():
    # r0 (1000 + 100 tokens) -> replica 0, r1 (16 + 100) -> replica 1. At 0.05 each has one request outstanding:
    # least-outstanding takes replica 0 (the tie's lowest index), least-tokens replica 1 (116 < 1100 tokens).
    req, _ = fleet(BY_TOKENS, "least-outstanding")
    assert list(req["replica"]) == [0, 1, 0]
    req, _ = fleet(BY_TOKENS, "least-tokens")
    assert list(req["replica"]) == [0, 1, 1]
    # Replica 1: r1 prefill 0.01 -> 0.11, one decode step -> 0.12, where r2 (arrived 0.05) is admitted: prefill
    # -> 0.22, decode -> 0.23, r2 done; r1 has 3 of 100 tokens at 0.23 and 97 more steps end at 1.2.
    assert list(req["admitted"]) == [0.0, 0.01, 0.12] and req.loc[2, "finished"] == 0.23
    assert req.loc[1, "finished"] == after(0.23, *[DECODE] * 97)


def test_requests_arriving_together_are_spread_as_they_are_routed():
    # Five at t=0: each routing sees the ones routed before it (its inbox counts as outstanding).
    for router in ROUTERS:
        req, _ = fleet([(0.0, 16, 2)] * 5, router)
        assert list(req["replica"]) == [0, 1, 0, 1, 0], router
        assert list(req["admitted"]) == [0.0] * 5


def test_an_idle_replica_is_scored_empty():
    req, result = fleet([(0.0, 16, 2)], replicas=3)
    per = metrics.per_replica(result.record, rate=1.0)
    assert list(per["replica"]) == [0, 1, 2] and list(per["n"]) == [1, 0, 0]
    assert list(per["share"]) == [1.0, 0.0, 0.0] and list(per["rate"]) == [1.0, 0.0, 0.0]
    # r0: prefill 0 -> 0.1, decode -> 0.11: one request in 0.11 s.
    assert per.loc[0, "served_rate"] == 1 / (0.1 + 0.01)
    assert per.loc[1:, "served_rate"].isna().all() and not per.loc[1:, "stable"].any()


def test_per_replica_summaries_split_the_fleet():
    _, result = fleet([(0.0, 16, 3), (0.05, 16, 2), (0.08, 16, 2)])  # test_round_robin_by_hand
    per = metrics.per_replica(result.record, rate=30.0)
    assert list(per["n"]) == [2, 1] and list(per["share"]) == [2 / 3, 1 / 3]
    assert list(per["rate"]) == [30.0 * 2 / 3, 30.0 * 1 / 3]
    assert per.loc[0, "served_rate"] == 2 / after(0.1, 0.01, 0.1, 0.01)
    assert per.loc[1, "served_rate"] == 1 / (after(0.05, 0.1, 0.01) - 0.05)
    # Replica 0 ran one row from 0 to 0.11 and two from 0.11 to 0.22: 1.5 on average; r2 queued 0.08-0.11 with
    # one row running. Replica 1 ran one row over its span.
    assert list(per["mean_running_rows"]) == pytest.approx([1.5, 1.0], rel=0, abs=1e-12)
    assert per.loc[0, "rows_while_queued"] == pytest.approx(1.0, rel=0, abs=1e-12)
    # The fleet's occupancy is per replica: (1 x 0.11 + 2 x 0.11 + 1 x 0.11) / (0.22 + 0.11) = 4/3 rows.
    occ = metrics.occupancy(result.record)
    assert occ["mean_running_rows"] == pytest.approx(4 / 3, rel=0, abs=1e-12)


def _bad_and_good() -> Trace:
    """The engine-reference case of test_sim (shape-dependent costs, a 2 ms retire cost, groups, a head waiting
    for blocks) with a request beyond the model's positions, which the engine refuses."""
    trace = poisson_trace(3.0, 100, 1)
    big = Request(100, trace.requests[50].arrival, 32600, 256)  # past the model's 32768 positions
    return Trace(sorted(trace.requests + [big], key=lambda r: r.arrival), trace.meta)


CORRECTED = Path(__file__).resolve().parents[1] / "results" / "calibration" / "t10" / "h200-t10-v26.json"


def _corrected(stretch_ends: bool = True) -> CostModel:
    """A table corrected from serving runs (the step before, idle time, a stretch's end); without its stretch-end
    term where a fleet of one must write what one engine writes: a replica, not foreseeing its arrivals, pays a
    stretch's end wherever a request could be admitted the moment it came (servecap/core/step_loop.py), and an
    engine fed a trace does not."""
    raw = copy.deepcopy(load_cost_table(CORRECTED).raw)
    assert raw["correction"]["factors"] and raw["correction"]["stretch_end"]["ends"]
    if not stretch_ends:
        del raw["correction"]["stretch_end"]
    return CostModel(raw)


FLEETS_OF_ONE = {
    "linear, retire cost, blocks bind, a refusal": (lambda: CostModel(linear_table()), _bad_and_good,
                                                    dict(backend="paged", max_batch=8, pool_blocks=150)),
    "padded, noise": (lambda: CostModel(linear_table(sigma=0.1)), lambda: poisson_trace(3.0, 120, 5),
                      dict(backend="dense", max_batch=16, pool_blocks=300, noise_seed=3)),
    "serving-corrected H200 table": (lambda: _corrected(stretch_ends=False), lambda: poisson_trace(40.0, 400, 0),
                                     dict(backend="paged", max_batch=32)),
    "closed, stepped": (lambda: _corrected(stretch_ends=False), lambda: closed_mixed(64, 0),
                        dict(backend="paged", max_batch=8, fast_forward=False)),
    # r1 arrives exactly when r0's first decode step ends (0.1 + 0.01 == 0.11): in that pass on one engine.
    "an arrival at a step's end": (lambda: CostModel(constant_table()),
                                   lambda: length_trace([(0.0, 16, 5), (0.11, 16, 2)]), dict(max_batch=4)),
}


@pytest.mark.parametrize("name", list(FLEETS_OF_ONE))
def test_a_fleet_of_one_writes_what_simulate_writes(name):
    make_cost, make_trace, cfg = FLEETS_OF_ONE[name]
    cost, trace = make_cost(), make_trace()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation notices
        one = simulate(trace, cost, sim_config(detail="tokens", **cfg))
        fleet_ = simulate_fleet(trace, cost, sim_config(detail="tokens", **cfg))
    for table in ("requests", "steps", "tokens", "rejected"):
        pd.testing.assert_frame_equal(getattr(one.record, table), getattr(fleet_.record, table), check_exact=True)
    assert fleet_.steps == one.steps
    drop = ("ended_at", "sim_passes")  # a replica's stretches stop at every arrival, so it makes more passes
    assert {k: v for k, v in fleet_.record.meta.items() if k not in drop} == \
        {**{k: v for k, v in one.record.meta.items() if k not in drop}, "replicas": 1, "router": "round-robin"}
    if name.startswith("an arrival"):
        assert list(fleet_.record.requests.sort_values("request_id")["admitted"]) == [0.0, 0.11]
    if name.startswith("linear"):
        assert list(fleet_.record.rejected["request_id"]) == [100]


@pytest.mark.parametrize("trace", [lambda: poisson_trace(60.0, 400, 0), lambda: closed_mixed(64, 0)],
                         ids=["arrivals", "closed"])
def test_replicas_charge_the_same_stretch_ends_stepping_as_fast_forwarding(trace):
    cost, trace = _corrected(), trace()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation notices
        fast, stepped = (simulate_fleet(trace, cost, sim_config(detail="tokens", backend="paged", max_batch=8,
                                                                 replicas=2, fast_forward=f)) for f in (True, False))
    assert stepped.passes > fast.passes
    # The replicas write into one record as their passes end, so the rows interleave by pass: compare them in order.
    for table, key in (("requests", ["request_id"]), ("steps", ["replica", "step", "kind"]),
                       ("tokens", ["request_id", "index"])):
        a, b = (getattr(r.record, table).sort_values(key, kind="stable", ignore_index=True) for r in (fast, stepped))
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_replicas_draw_their_own_noise():
    trace = closed_uniform("p256", 64, budget=64)
    cost = CostModel(linear_table(sigma=0.1))
    rec = simulate_fleet(trace, cost, sim_config(max_batch=8, noise_seed=1, detail="steps", replicas=2)).record
    prefill = rec.steps[rec.steps["kind"] == "prefill"]
    # The same work on both replicas (round-robin halves a uniform trace) takes different times.
    first = prefill.groupby("replica")["end"].first()
    assert first[0] != first[1]
    one = simulate(trace, cost, sim_config(max_batch=8, noise_seed=1, detail="steps")).record
    assert one.steps["end"].iloc[0] == first[0]  # replica 0 draws what one engine draws


@pytest.mark.parametrize("replicas, router, message", [
    (0, "round-robin", "a whole number of replicas >= 1, got 0"),
    (2, "fastest", "unknown router 'fastest'; choose round-robin, least-outstanding, least-tokens"),
])
def test_a_fleet_refuses_bad_shapes(replicas, router, message):
    with pytest.raises(InputError, match=message):
        simulate_fleet(poisson_trace(1.0, 5, 0), CostModel(constant_table()),
                       sim_config(replicas=replicas, router=router))
