"""The per-step token cap (max_num_batched_tokens): admission groups cut where a padded or packed prefill step
would pass it, the engine's loop and the simulator's agreeing under it, what it refuses, and the calibration plan
that measures a 32-row engine with full-length prompts under it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import CostRunner, RetireCostRecorder, VirtualClock, linear_table, run_cli, serve_virtual, sim_config

from servecap.calibrate.measure import measure
from servecap.calibrate.plan import FULL, FULL_LENGTH, Run, _on, make_plan
from servecap.calibrate.points import decode_points
from servecap.core.config import ServingConfig
from servecap.core.policies import every_policy
from servecap.costs.model import CostModel
from servecap.engine.serve import serve
from servecap.sim.simulator import simulate
from servecap.traces.errors import InputError
from servecap.traces.records import RunWriter
from servecap.traces.workload import Request, length_trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # derived-cost notices of the synthetic table


def _trace(n: int = 150, seed: int = 3):
    rng = np.random.default_rng(seed)
    return length_trace([(float(t), int(p), int(b)) for t, p, b in
                         zip(np.cumsum(rng.exponential(1 / 40, n)), rng.integers(1, 400, n), rng.integers(1, 40, n))])


@pytest.mark.parametrize("policy", ["padded", "packed"])
def test_a_step_cap_cuts_admission_groups_so_no_prefill_step_computes_more(policy):
    cost = CostModel(linear_table())
    steps = {cap: simulate(_trace(), cost, sim_config(max_batch=16, prefill=policy, detail="steps",
                                                      max_num_batched_tokens=cap)).record.steps
             for cap in (None, 600)}
    computed = {cap: (s.rows * s.padded_len if policy == "padded" else s.prompt_tokens)[s.kind == "prefill"]
                for cap, s in steps.items()}
    assert computed[None].max() > 600  # the trace's groups do pass the cap when nothing bounds them
    assert computed[600].max() <= 600
    assert (steps[600].kind == "prefill").sum() > (steps[None].kind == "prefill").sum()  # more, smaller groups


@pytest.mark.parametrize("policy", ["padded", "packed", "mixed:64"])
def test_the_simulator_replays_the_engine_loop_under_a_step_cap(policy):
    cost = CostModel(linear_table())
    trace = _trace(100, 5)
    engine = serve_virtual(trace, cost, "paged", max_batch=8, pool_blocks=150, policy=policy,
                           max_num_batched_tokens=500)
    sim = simulate(trace, cost, sim_config(max_batch=8, pool_blocks=150, prefill=policy, detail="tokens",
                                           max_num_batched_tokens=500)).record
    for table in ("requests", "steps", "tokens"):
        a, b = (getattr(r, table).sort_values(list(getattr(r, table).columns[:2])).reset_index(drop=True)
                for r in (engine, sim))
        num = a.select_dtypes("number").columns
        pd.testing.assert_frame_equal(a[num], b[num], check_exact=False, rtol=0, atol=1e-9)


def test_fast_forward_is_exact_where_the_cap_held_a_head_back():
    """A head the cap left out is admitted in the next pass: a decode stretch must stop for it there."""
    cost = CostModel(linear_table())
    runs = [simulate(_trace(), cost, sim_config(max_batch=16, detail="tokens", fast_forward=ff,
                                                max_num_batched_tokens=450)).record for ff in (True, False)]
    for table in ("requests", "steps", "tokens"):
        pd.testing.assert_frame_equal(getattr(runs[0], table), getattr(runs[1], table), check_exact=True)


def test_what_a_step_cap_cannot_serve_is_refused_in_one_line(capsys):
    sched = ServingConfig(max_num_batched_tokens=100).scheduler(1000, None)
    with pytest.raises(InputError, match=r"request 7: its prefill of 101 positions is beyond the per-step cap "
                                         r"\(max_num_batched_tokens 100\); chunked:N or mixed:N prefill splits it"):
        sched.submit(Request(7, 0.0, 101, 5))
    sched.submit(Request(8, 0.0, 100, 5))  # the cap itself fits
    ServingConfig(prefill="chunked:64", max_num_batched_tokens=100).scheduler(1000, None).submit(
        Request(9, 0.0, 5000, 5))  # a chunking policy splits any prompt
    # on-demand: a preempted request recomputes what it generated too, in one step
    with pytest.raises(InputError, match="its prefill of 104 positions"):
        ServingConfig(admission="on-demand", max_num_batched_tokens=100).scheduler(1000, None).submit(
            Request(1, 0.0, 100, 5))
    for bad, message in ((dict(prefill="chunked:512", max_num_batched_tokens=256), "more than the per-step cap"),
                         (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a whole number")):
        with pytest.raises(InputError, match=message):
            ServingConfig(**bad)
    from servecap.sim.cli import main
    code, out, err = run_cli(main, capsys, "run", "--closed-uniform", "p4096", "--n", "4",
                             "--max-num-batched-tokens", "1000")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "max_num_batched_tokens 1000" in err
    code, out, err = run_cli(main, capsys, "run", "--closed-uniform", "p256", "--n", "8",
                             "--max-num-batched-tokens", "1000")
    assert code == 0 and "step cap 1000 tokens" in out  # the summary names the configuration it simulated


def test_the_full_length_plan_keeps_every_step_within_its_cap_and_covers_both_ranges():
    runs = make_plan(FULL_LENGTH, 32, ("paged",), tuple(map(str, every_policy(FULL_LENGTH.chunk))))
    cap = FULL_LENGTH.max_step_tokens
    assert len({r.key for r in runs}) == len(runs)
    for r in runs:
        group = r.width * r.padded_len if r.policy == "padded" else sum(r.prompts) if r.policy == "packed" else 0
        if r.kind == "decode" and r.width in FULL_LENGTH.long_rows:
            continue  # prefilled in several groups: its points are the steps that hold every row
        assert group <= cap, r.label
    grid = {(r.width, r.padded_len) for r in runs if r.kind == "prefill" and r.policy == "padded"}
    full = {(r.width, r.padded_len) for r in make_plan(FULL, 32, ("paged",)) if r.kind == "prefill"}
    assert full <= grid  # FULL's whole grid at 32 rows
    assert {(w, 32256) for w in (1, 2, 4)} <= grid and (8, 32256) not in grid
    split = [r for r in runs if r.kind == "decode" and r.width * r.padded_len > cap]
    assert {(r.width, r.padded_len) for r in split} == {(w, n) for w in (8, 16, 32) for n in (8192, 16384, 32256)
                                                        if w * n > cap}
    assert all(r.budget == FULL_LENGTH.max_budget for r in split if r.padded_len == FULL_LENGTH.max_prompt)


class _VirtualEngine:
    """engine.run's shape on a virtual clock (the loop and scheduler the engine uses, no GPU)."""

    def __init__(self, serving: ServingConfig, cost: CostModel, num_blocks: int = 4000):
        self.cfg = type("Cfg", (), {"serving": serving})()
        self.cost, self.num_blocks = cost, num_blocks

    def run(self, trace, out, backend: str, policy: str, progress: bool, telemetry: bool):
        clock, writer = VirtualClock(), RunWriter(None, {})
        serve(trace, CostRunner(self.cost, clock, self.num_blocks),
              RetireCostRecorder(writer, backend, clock, self.cost.retire_s),
              self.cfg.serving.but(prefill=policy), self.num_blocks, clock=clock)
        return writer.record()


def test_a_decode_run_the_cap_splits_into_groups_is_measured_on_the_steps_that_hold_every_row():
    serving = ServingConfig(max_batch=8, max_num_batched_tokens=256)
    cost = CostModel(linear_table())
    run = Run("decode", (100,) * 8, 40, serving, label="decode paged 8 rows x 100")
    sample = measure(_VirtualEngine(serving, cost), run)
    kv = np.asarray(sample["kv_tokens"])
    assert len(kv) >= 4 and (np.diff(kv) == 8).all()  # one token a row a step, every row in every step
    assert all(p["rows"] == 8 for p in decode_points(run, sample, 8))
    # With the whole run in one group the same run has every decode step at 8 rows from the first.
    uncapped = serving.but(max_num_batched_tokens=None)
    whole = measure(_VirtualEngine(uncapped, cost), Run("decode", run.prompts, run.budget, uncapped))
    assert len(whole["kv_tokens"]) > len(kv)
    # A prefill run that the engine splits is not what the plan measured: refused.
    with pytest.raises(RuntimeError, match="did not admit the run as one group of 8"):
        measure(_VirtualEngine(serving, cost), Run("prefill", (100,) * 8, 1, serving, reps=1))


def test_the_plan_runs_carry_its_cap():
    assert _on(FULL_LENGTH, "paged").max_num_batched_tokens == FULL_LENGTH.max_step_tokens
    assert _on(FULL, "paged").max_num_batched_tokens is None
