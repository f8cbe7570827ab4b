"""A run replayed through the simulator's scheduler at its own recorded step times (servecap/sim/replay.py):
identical to the run wherever the scheduling is the engine's, and not identical, naming the step, where it is not."""
from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import linear_table, run_cli, serve_virtual

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from servecap.costs.model import CostModel  # noqa: E402
from servecap.sim.replay import replay  # noqa: E402
from servecap.traces.errors import InputError  # noqa: E402
from servecap.traces.trace_io import write_trace  # noqa: E402
from servecap.traces.workload import length_trace, poisson_trace  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # derived-cost notices of the synthetic tables
COST = CostModel(linear_table())  # step costs follow the shapes; retiring a row costs 2 ms


@settings(max_examples=40, deadline=None)
@given(triples=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 1500), st.integers(1, 60)), min_size=1,
                        max_size=40),
       max_batch=st.integers(1, 8), pool_blocks=st.sampled_from([12, 40, 400]),
       policy=st.sampled_from(["padded", "packed", "chunked:64", "mixed:64"]),
       admission=st.sampled_from(["reserve", "on-demand"]), asynchronous=st.booleans(),
       jitter=st.sampled_from([0.0, 1.0]))
def test_the_engines_own_runs_replay_identically(triples, max_batch, pool_blocks, policy, admission, asynchronous,
                                                  jitter):
    """The engine's loop on a virtual device (launching decode steps ahead when asynchronous, its steps' times
    varying when jittered, retiring at a cost, preempting when on demand) gives records whose every step and
    request time the replay reproduces."""
    trace = length_trace(sorted(triples))
    rec = serve_virtual(trace, COST, "paged", max_batch, pool_blocks, policy, asynchronous, jitter,
                        admission=admission)
    r = replay(rec, trace)
    assert r.divergence is None and r.used == r.recorded == len(rec.steps)
    assert r.identical, {c: r.error_s(c) for c in ("admitted", "first_token", "finished")}


def test_decode_steps_the_engine_ran_past_an_arrival_are_replayed_as_it_counted_them():
    """A step launched ahead that outlasts the margin runs past an admissible arrival; the record counts it
    (decode_overruns) and the replay takes it: identical. Told there was none, the replay is not."""
    overran = 0
    for seed in range(6):
        trace = poisson_trace(6.0, 80, seed)
        rec = serve_virtual(trace, COST, "paged", 8, 400, asynchronous=True, jitter=1.0)
        assert replay(rec, trace).identical
        if rec.meta["decode_overruns"]:
            overran += 1
            assert not replay(dataclasses.replace(rec, meta={**rec.meta, "decode_overruns": 0}), trace).identical
    assert overran  # the case is exercised


def test_a_replay_under_another_configuration_names_the_first_step_that_differs():
    trace = poisson_trace(6.0, 60, 2)
    rec = serve_virtual(trace, COST, "paged", 8, 400, asynchronous=True)
    assert replay(rec, trace).identical
    other = dataclasses.replace(rec, meta={**rec.meta, "max_batch": 4})
    r = replay(other, trace)
    assert not r.identical and r.divergence is not None
    assert "row(s)" in r.divergence.recorded and r.divergence.recorded != r.divergence.asked


def test_a_record_whose_step_took_longer_than_recorded_is_not_identical():
    """One step's recorded end moved 5 ms later (every later step as it was): the replay's times move with it."""
    trace = poisson_trace(6.0, 60, 2)
    rec = serve_virtual(trace, COST, "paged", 8, 400, asynchronous=True)
    steps = rec.steps.copy()
    i = len(steps) // 2
    steps.loc[steps.index[i], "end"] += 0.005
    r = replay(dataclasses.replace(rec, steps=steps), trace)
    assert not r.identical


def test_a_fleets_record_is_refused():
    trace = poisson_trace(6.0, 20, 2)
    rec = serve_virtual(trace, COST, "paged", 8, 400)
    with pytest.raises(InputError, match="fleet"):
        replay(dataclasses.replace(rec, meta={**rec.meta, "replicas": 2}), trace)


def _on_disk(rec, trace, tmp_path):
    from servecap.traces.records import RunWriter
    w = RunWriter(tmp_path / "run", rec.meta)
    for t in ("requests", "steps", "rejected"):
        w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    w.close(**{k: rec.meta[k] for k in ("decode_overruns",)})
    return tmp_path / "run", write_trace(trace, tmp_path / "trace.csv")


def test_sim_replay_says_identical_or_names_the_step_and_refuses_another_trace(tmp_path, capsys):
    from servecap.sim.cli import main
    trace = poisson_trace(6.0, 60, 2)
    rec = serve_virtual(trace, COST, "paged", 8, 400, asynchronous=True)
    run, path = _on_disk(rec, trace, tmp_path)
    code, out, _ = run_cli(main, capsys, "replay", run, "--trace", path)
    assert code == 0 and out.startswith(f"identical: {len(rec.steps)} steps as the engine ran them")
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "max_batch": 4}))
    code, out, _ = run_cli(main, capsys, "replay", run, "--trace", path)
    assert code == 1 and out.startswith("not identical: step ") and "the scheduler asked for" in out
    other = write_trace(poisson_trace(6.0, 60, 3), tmp_path / "other.csv")
    code, _, err = run_cli(main, capsys, "replay", run, "--trace", other)
    assert code == 2 and "is not the trace this run served" in err and err.count("\n") == 1
    code, _, err = run_cli(main, capsys, "replay", tmp_path / "nothing", "--trace", path)
    assert code == 2 and err.count("\n") == 1
