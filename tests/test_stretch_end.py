"""The stretch-end term: a decode step that ends its stretch holds the engine's host work at that end
(servecap/costs/context.py), charged by the step loop where the next pass plans other work (Scheduler.stretch_goes_on),
fitted by `calibrate --from-runs` and priced back on records."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from helpers import linear_table, serve_virtual, sim_config

from servecap.calibrate.from_runs import describe, fit
from servecap.core.step_loop import StepLoop, TraceArrivals, drive
from servecap.costs.model import CostModel
from servecap.costs.recorded import contextual, priced_steps, stretch_ends
from servecap.core.recorder import Recorder
from servecap.sim.fleet import simulate_fleet
from servecap.sim.simulator import SimTimer, simulate
from servecap.traces.errors import InputError
from servecap.traces.records import RunWriter
from servecap.traces.workload import Trace, length_trace, poisson_trace

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # derived-cost notices of the synthetic tables

# Seconds a stretch's end costs by its length, per decode kind: long stretches' ends cost more, as in v26's runs.
ENDS = {"decode paged padded|s1-2": 0.0010, "decode paged padded|s3-4": 0.0015, "decode paged padded": 0.0030,
        "decode paged chunked": 0.0020, "decode paged": 0.0025}


def ended_table(ends: dict[str, float] = ENDS) -> dict:
    raw = linear_table()
    raw.update(version=3, correction={"factors": {}, "min_steps": 30,
                                      "stretch_end": {"ends": {k: {"s": s, "n": 100} for k, s in ends.items()}}})
    return raw


COST = CostModel(ended_table())
triples_st = st.lists(st.tuples(st.floats(0, 2), st.integers(1, 1500), st.integers(1, 120)), min_size=1, max_size=40)
configs_st = st.tuples(st.integers(1, 8), st.sampled_from([8, 14, 40, 400]),
                       st.sampled_from(("padded", "packed", "chunked:64", "mixed:64")),
                       st.sampled_from(("reserve", "on-demand")), st.booleans())


def _serving(max_batch, pool_blocks, policy, admission, cache) -> dict:
    return dict(max_batch=max_batch, pool_blocks=pool_blocks, prefill=policy, admission=admission,
                prefix_cache=cache)


def _trace(triples, cache: bool) -> Trace:
    """The triples as a trace; with the cache on, requests in four groups sharing their prompts' first blocks (hash
    ids of 512-token blocks, whole pool blocks), so that prefixes are shared and a head can wait on the cache."""
    trace = length_trace(triples)
    if not cache:
        return trace
    return Trace([dataclasses.replace(r, hash_ids=tuple(1000 * (i % 4) + j for j in range(-(-r.prompt_tokens // 512))),
                                      hash_block=512) for i, r in enumerate(trace.requests)], trace.meta)


def test_a_stretch_end_is_priced_by_its_length_with_fallbacks_and_scaled_as_every_step():
    c = COST.correction
    assert c.stretch_end("decode paged padded", 1) == c.stretch_end("decode paged padded", 2) == 0.0010
    assert c.stretch_end("decode paged padded", 4) == 0.0015
    assert c.stretch_end("decode paged padded", 5) == 0.0030  # no class of its own: the kind's
    assert c.stretch_end("decode paged packed", 5) == 0.0025  # no kind of its own: the backend's
    assert COST.stretch_end_s("paged", "chunked:64", 7) == 0.0020
    scaled = CostModel({**ended_table(), "correction": {**ended_table()["correction"], "scale": 1.1}})
    assert scaled.stretch_end_s("paged", "padded", 1) == pytest.approx(0.0011)
    assert CostModel(linear_table()).stretch_end_s("paged", "padded", 1) == 0.0  # no correction: nothing
    few = CostModel(ended_table()).correction.raw
    few["stretch_end"]["ends"]["decode paged padded|s1-2"]["n"] = 3
    assert CostModel({**ended_table(), "correction": few}).stretch_end_s("paged", "padded", 1) == 0.0030


@pytest.mark.parametrize("bad", [{"s": -0.001, "n": 10}, {"s": float("nan"), "n": 10}, {"n": 10}, {"s": 0.001}])
def test_a_malformed_stretch_end_is_refused_in_one_line(bad):
    raw = ended_table()
    raw["correction"]["stretch_end"]["ends"]["decode paged padded"] = bad
    with pytest.raises(InputError, match="stretch_end"):
        CostModel(raw)


@SETTINGS
@given(triples=triples_st, config=configs_st)
def test_the_scheduler_says_a_stretch_goes_on_exactly_when_the_next_pass_only_decodes_its_rows(triples, config):
    """stretch_goes_on() (asked after a pass that ran decode steps and retired nothing) answers what schedule()
    then plans: no admission, no prefill step, no preemption, the same rows."""
    trace = _trace(triples, config[-1])
    serving = sim_config(**_serving(*config)).serving
    pool = serving.pool_blocks(max(r.prompt_tokens + r.budget for r in trace.requests))
    sched = serving.scheduler(pool, serving.max_positions)
    asked, checked = [], []
    goes_on, schedule = sched.stretch_goes_on, sched.schedule
    last_rows: list = []

    def said() -> bool:
        asked.append(goes_on())
        return asked[-1]

    def planned(now, step, lookahead=None):
        plan = schedule(now, step, lookahead)
        if asked:
            went_on = not plan.group and plan.prefill is None and not plan.preempted and plan.rows == last_rows
            checked.append((asked.pop(), went_on))
        last_rows[:] = plan.rows
        return plan

    sched.stretch_goes_on, sched.schedule = said, planned
    writer = RunWriter(None, {"kind": "sim"}, ("requests", "steps", "rejected"))
    timer = SimTimer(COST, "paged", False, None, str(serving.prefill))  # stepping: asked after every decode step
    drive(StepLoop(sched, Recorder(writer, "paged"), timer, TraceArrivals(trace.requests)), timer)
    assert all(a == b for a, b in checked), checked


@SETTINGS
@given(triples=triples_st, config=configs_st)
def test_fast_forward_charges_the_stretch_ends_stepping_one_step_a_pass_charges(triples, config):
    trace = _trace(triples, config[-1])
    runs = [simulate(trace, COST, sim_config(detail="tokens", fast_forward=ff, **_serving(*config))).record
            for ff in (True, False)]
    for table in ("requests", "steps", "tokens", "rejected"):
        assert getattr(runs[0], table).equals(getattr(runs[1], table)), table


@pytest.mark.parametrize("policy", ["padded", "chunked:64"])
def test_the_simulator_is_the_engine_loop_whose_host_pays_each_stretchs_end(policy):
    """engine.serve.serve on a virtual clock whose host spends the table's stretch end after reading a stretch's
    tokens writes the simulator's records, and the ends are really charged (the run is longer without them).
    (A synchronous runner, as tests/test_sim.py's: an asynchronous one writes retired rows' records behind the next
    step, which the simulator charges as the table's retire_s.)"""
    trace = poisson_trace(3.0, 80, 2)
    serving = dict(max_batch=8, pool_blocks=150, prefill=policy)
    engine = serve_virtual(trace, COST, "paged", 8, 150, policy=sim_config(**serving).serving.prefill)
    sim = simulate(trace, COST, sim_config(detail="tokens", **serving)).record
    for table in ("requests", "steps", "tokens"):
        a, b = (getattr(r, table).sort_values(list(getattr(r, table).columns[:2])).reset_index(drop=True)
                for r in (engine, sim))
        num = a.select_dtypes("number").columns
        pd.testing.assert_frame_equal(a[num], b[num], check_exact=False, rtol=0, atol=1e-9)
    plain = simulate(trace, CostModel(linear_table()), sim_config(**serving)).record
    assert sim.requests.finished.max() > plain.requests.finished.max() + 0.001


class RoutedArrivals(TraceArrivals):
    """A trace's requests as a replica behind a router sees them (servecap/engine/fleet.py QueueArrivals): each known
    only once it has come, so an admission may come at any moment."""

    foreseen = False

    def next_candidate(self, sched):
        return -math.inf, None


@pytest.mark.parametrize("policy", ["padded", "chunked:64"])
def test_a_simulated_replica_behind_a_router_pays_the_stretch_ends_the_engines_replica_pays(policy):
    """The engine's loop fed as a replica behind a router is (on a virtual clock whose host spends the table's
    stretch end after reading a stretch's tokens) a simulated fleet's replica: the same records, every decode step
    with a row free a stretch of its own, each end charged; and that costs more than one engine replaying the trace,
    whose lookahead knows when the next request comes."""
    trace = poisson_trace(3.0, 80, 2)
    serving = dict(max_batch=8, pool_blocks=150, prefill=policy)
    prefill = sim_config(**serving).serving.prefill
    engine = serve_virtual(trace, COST, "paged", 8, 150, policy=prefill, arrivals=RoutedArrivals(trace.requests))
    one = simulate_fleet(trace, COST, sim_config(detail="tokens", **serving)).record  # a fleet of one replica
    for table in ("requests", "steps", "tokens"):
        a, b = (getattr(r, table).sort_values(list(getattr(r, table).columns[:2])).reset_index(drop=True)
                for r in (engine, one))
        num = [c for c in a.select_dtypes("number").columns if c != "replica"]
        pd.testing.assert_frame_equal(a[num], b[num], check_exact=False, rtol=0, atol=1e-9)
    single = simulate(trace, COST, sim_config(**serving)).record
    assert one.requests.finished.max() > single.requests.finished.max() + 0.001


@pytest.mark.parametrize("policy", ["padded", "packed", "chunked:64", "mixed:64"])
def test_a_simulated_record_priced_in_context_gives_back_its_step_times_ends_included(policy):
    trace = length_trace([(0.004 * i, 100 + 53 * i % 700, 30 + i % 50) for i in range(80)])
    rec = simulate(trace, COST, sim_config(detail="steps", max_batch=8, prefill=policy)).record
    steps = priced_steps(rec, COST)
    assert (steps.stretch_end > 0).sum() > 20
    assert np.allclose(contextual(steps, COST.correction), steps.real_s.to_numpy(), rtol=1e-9, atol=0)


def test_the_steps_a_stretch_ends_are_read_from_a_record():
    """A decode step ends its stretch unless the next step of its replica goes on from it: the same rows each a
    token longer, nothing retired or preempted; replicas apart."""
    steps = pd.DataFrame({
        "kind": ["prefill", "decode", "decode", "decode", "decode", "decode", "decode", "decode", "decode"],
        "replica": [0, 0, 1, 0, 1, 0, 0, 0, 0],
        "rows": [2, 2, 3, 2, 3, 2, 1, 1, 1],
        "kv_max": [0, 10, 50, 11, 51, 12, 13, 14, 20],
        "kv_tokens": [0, 15, 90, 17, 93, 19, 13, 14, 20],
        "retired": [0, 0, 0, 0, 0, 1, 0, 0, 0],
        "preempted": [0, 0, 0, 0, 0, 0, 0, 0, 1]})
    steps = steps.sort_values(["replica"], kind="stable").reset_index(drop=True)
    # replica 0: prefill, decode x3 (the third retires), 1 row on (another stretch) x2, then a preemption; replica 1
    assert stretch_ends(steps).tolist() == [0, 0, 0, 3, 0, 2, 1, 0, 2]


def test_from_runs_recovers_the_stretch_ends_a_run_was_simulated_with():
    """Records simulated with known ends (and no factors) give them back, the factors staying at 1: an end is
    not spread over the stretch's other steps."""
    ends = {"decode paged padded|s1-2": 0.0010, "decode paged padded|s3-4": 0.0015,
            "decode paged padded|s5-8": 0.0020, "decode paged padded": 0.0030}
    truth = CostModel(ended_table(ends))
    trace = poisson_trace(8.0, 600, 7)
    rec = simulate(trace, truth, sim_config(detail="steps", max_batch=8, pool_blocks=200)).record
    c = fit(priced_steps(rec, CostModel(linear_table())))
    got = {k: v["s"] for k, v in c["stretch_end"]["ends"].items() if "|" in k}
    assert len(got) >= 5  # lengths of every bucket the truth has, and longer
    for k, s in got.items():  # each length's own: the truth's bucket, or its kind's
        assert s == pytest.approx(ends.get(k, ends["decode paged padded"]), rel=0.02), k
    assert c["factors"]["decode paged padded"]["factor"] == pytest.approx(1.0, abs=0.005)
    said = describe({"stretch_end": c["stretch_end"]["ends"]})  # the report prints them, in ms
    assert "stretch ends" in said and "s1-2 1.000" in said and "s3-4 1.500" in said
