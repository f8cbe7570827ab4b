"""The engine writes a pass's records while its next pass's first step runs (servecap/core/recorder.py WriteBehind,
servecap/engine/serve.py): the same rows in the same order as written at once, none lost when a run stops short."""
from __future__ import annotations

import pytest

from servecap.core.config import ServingConfig
from servecap.core.recorder import Recorder, WriteBehind
from servecap.costs.model import CostModel
from servecap.engine.serve import serve
from servecap.traces.records import RunWriter, StepRow
from servecap.traces.workload import poisson_trace

from helpers import CostRunner, VirtualClock, linear_table


def served(asynchronous: bool, policy: str, fail_at: int | None = None):
    """One trace through the engine's loop, step times from a cost table on a virtual clock; the runner says
    whether it is asynchronous (then the records are written behind). `fail_at`: the runner fails at that step."""
    cost = CostModel(linear_table())
    clock = VirtualClock()
    runner = CostRunner(cost, clock, 2000, asynchronous)
    if fail_at is not None:
        launch, count = runner.launch_next, iter(range(1 << 30))

        def failing(j):
            if next(count) == fail_at:
                raise RuntimeError("the device went away")
            launch(j)
        runner.launch_next = failing
    writer = RunWriter(None, {})
    trace = poisson_trace(rate=40, n=120, seed=3)
    try:
        serve(trace, runner, Recorder(writer, "paged"), ServingConfig(max_batch=8, prefill=policy),
              2000, clock=clock)
    except RuntimeError:
        pass
    return writer.record()


@pytest.mark.parametrize("policy", ["padded", "chunked:128", "mixed:128"])
def test_records_written_behind_are_the_records_written_at_once(policy):
    now, behind = served(False, policy), served(True, policy)
    assert len(now.requests) == 120 and len(now.steps) > 120
    for table in ("requests", "steps", "tokens"):
        assert getattr(behind, table).equals(getattr(now, table)), table


def test_a_run_that_stops_short_keeps_every_row_it_made():
    now, behind = served(False, "padded", fail_at=500), served(True, "padded", fail_at=500)
    assert 0 < len(behind.requests) < 120
    for table in ("requests", "steps", "tokens"):
        assert getattr(behind, table).equals(getattr(now, table)), table


def test_a_prefill_row_is_made_when_the_step_ends_and_written_at_the_flush():
    writer = RunWriter(None, {})
    log = WriteBehind(Recorder(writer, "paged"))
    made = []
    row = StepRow._make(range(len(StepRow._fields)))
    log.log.prefill_row = lambda *args: made.append(args) or row
    log.prefill(0, None, 1, 0, 0.0, 1.0)
    assert made == [(0, None, 1, 0, 0.0, 1.0)] and len(writer.record().steps) == 0  # made at once, not written
    log.flush()
    assert writer.record().steps["step"].tolist() == [0] and len(made) == 1


def test_the_queues_head_is_made_ready_while_a_step_runs_and_every_prompt_it_held_is_ready_at_its_launch():
    """serve's host work behind the device (servecap/engine/serve.py): each pass, once its first step is launched,
    the runner prepares the queue's head (at most max batch requests, all still waiting); past capacity nearly every
    prompt has waited there, so its ids are made before the prefill step that needs them is launched."""
    cost, clock = CostModel(linear_table()), VirtualClock()
    runner = CostRunner(cost, clock, 2000, asynchronous=True)
    prepared, calls, unready = set(), [], []
    launch = runner.launch_prefill

    def prepare(seqs):
        seqs = list(seqs)
        calls.append([(s.kv_len, s.prefilling) for s in seqs])  # as they are now: still waiting
        prepared.update(s.req.request_id for s in seqs)

    def launch_prefill(work):
        unready.extend(s.req.request_id for s, p in zip(work.seqs[work.decode:], work.prefix[work.decode:])
                       if p == 0 and s.req.request_id not in prepared)
        launch(work)
    runner.prepare, runner.launch_prefill = prepare, launch_prefill
    serving = ServingConfig(max_batch=8, prefill="chunked:128")
    sched, _ = serve(poisson_trace(rate=400, n=200, seed=4), runner, Recorder(RunWriter(None, {}), "paged"), serving,
                     2000, clock=clock)
    assert sched.submitted == 200 and calls
    assert max(len(c) for c in calls) == 8 and all(state == (0, False) for c in calls for state in c)
    assert len(unready) < 200 * 0.05, unready
