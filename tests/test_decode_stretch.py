"""The engine's decode stretches (servecap/engine/serve.py EngineTimer): on an asynchronous runner the next step is
launched before the last one's end is read, so the host's work between steps hides behind the device's, while the
stretch is cut exactly where the step loop's contract cuts it (after the first step ending at or after `stop`)."""
from __future__ import annotations

import math

import pytest

from servecap.engine.serve import AHEAD, EngineTimer

from helpers import VirtualClock

HOST_S = 0.0002  # the host's work to launch one step
STEP_S = 0.002  # the device's time for one step


class FakeRunner:
    """Steps on a virtual device: a launch costs the host HOST_S, the device runs launched steps in order, each
    for durations(j); wait() lets the host's clock reach a step's end."""

    def __init__(self, clock: VirtualClock, asynchronous: bool, durations=lambda j: STEP_S):
        self.clock, self.asynchronous, self.durations = clock, asynchronous, durations
        self.free_at = 0.0
        self.device_ends: list[float] = []
        self.most_in_flight = 0
        self.observed = 0

    def stretch_cap(self, rows) -> int:
        return 1 << 20

    def launch_decode(self, rows, backend: str) -> None:
        self.rows, self.device_ends, self.observed = len(rows), [], 0
        self.launch_next(0)

    def launch_next(self, j: int) -> None:
        assert j == len(self.device_ends), "steps are launched in order"
        self.clock.t += HOST_S
        start = max(self.clock.t, self.free_at)
        self.free_at = start + self.durations(j)
        self.device_ends.append(self.free_at)
        if not self.asynchronous:  # the launch returns once the step is done
            self.clock.t = self.free_at
        self.most_in_flight = max(self.most_in_flight, len(self.device_ends) - self.observed)

    def wait(self, j: int) -> None:
        assert j == self.observed, "ends are read in order"
        self.clock.t = max(self.clock.t, self.device_ends[j])
        self.observed += 1

    def stretch_result(self, steps: int) -> list[list[int]]:
        assert steps == len(self.device_ends)
        return [[100 * r + j for j in range(steps)] for r in range(self.rows)]


def stretch(asynchronous: bool, limit: int, stop: float, durations=lambda j: STEP_S, warm: bool = True):
    """One stretch of 3 rows from t = 0 (after a first stretch that sets the timer's pace, when `warm`)."""
    clock = VirtualClock()
    runner = FakeRunner(clock, asynchronous, durations)
    timer = EngineTimer(runner, "paged", clock)
    if warm:
        timer.decode([None] * 3, None, 0.0, 2, math.inf)
        clock.t = runner.free_at = 0.0
    tokens, ends = timer.decode([None] * 3, None, 0.0, limit, stop)
    return timer, runner, tokens, ends


def test_launching_ahead_hides_the_hosts_work_behind_the_devices():
    _, sync_runner, _, sync_ends = stretch(False, 20, math.inf)
    timer, runner, tokens, ends = stretch(True, 20, math.inf)
    assert len(ends) == len(sync_ends) == 20
    # Synchronous: every step pays the host's launch; ahead: only the first, the rest back to back on the device.
    assert sync_ends[-1] == pytest.approx(20 * (HOST_S + STEP_S))
    assert ends[-1] == pytest.approx(HOST_S + 20 * STEP_S)
    assert ends == pytest.approx(runner.device_ends)
    assert runner.most_in_flight == AHEAD and sync_runner.most_in_flight == 1
    assert tokens == [[100 * r + j for j in range(20)] for r in range(3)] and timer.overruns == 0


@pytest.mark.parametrize("stop", [0.0005, 0.0111, 0.0123, 0.02, 0.0301])
def test_a_stretch_is_cut_after_the_first_step_ending_at_or_after_stop_as_the_contract_says(stop):
    for asynchronous in (False, True):
        timer, runner, _, ends = stretch(asynchronous, 40, stop)
        first = next(i for i, e in enumerate(runner.device_ends) if e >= stop)
        assert len(ends) == first + 1, asynchronous
        assert timer.overruns == 0


def test_without_a_pace_yet_the_first_stretch_reads_each_end_before_it_launches_past_a_stop():
    timer, runner, _, ends = stretch(True, 40, 0.0111, warm=False)
    assert len(ends) == next(i for i, e in enumerate(runner.device_ends) if e >= 0.0111) + 1
    assert timer.overruns == 0


def test_a_step_that_outlasts_the_margin_runs_the_step_launched_ahead_and_is_counted():
    slow = 4  # the fifth step takes ten steps' time; an arrival comes while it runs
    timer, runner, _, ends = stretch(True, 40, 0.015, lambda j: STEP_S * (10 if j == slow else 1))
    assert runner.device_ends[slow] >= 0.015 > runner.device_ends[slow - 1]
    assert len(ends) == slow + 2  # the step launched ahead of the slow one's end runs
    assert timer.overruns == 1


def test_a_stretch_stops_at_its_limit_and_where_the_runner_holds_no_more_steps():
    timer, runner, _, ends = stretch(True, 7, math.inf)
    assert len(ends) == len(runner.device_ends) == 7
    runner.stretch_cap = lambda rows: 3
    _, ends = timer.decode([None] * 3, None, runner.clock.t, 7, math.inf)
    assert len(ends) == 3


def test_the_hosts_other_work_runs_once_the_passs_first_steps_are_on_the_device_and_hides_behind_them():
    calls = []

    def run(host_s: float):
        clock = VirtualClock()
        runner = FakeRunner(clock, True)

        def while_running():
            calls.append(len(runner.device_ends) - runner.observed)  # steps launched and not yet read
            clock.t += host_s

        timer = EngineTimer(runner, "paged", clock, while_running)
        return timer.decode([None] * 3, None, 0.0, 10, math.inf)[1]

    quiet = run(0.0)
    assert calls == [AHEAD]  # once per stretch, with AHEAD steps in flight
    assert run(STEP_S / 2) == pytest.approx(quiet)  # done before the first step's end: hidden
    # Longer than the first step, shorter than the steps in flight: the first end is read late, the device's
    # steps are the same.
    late = run(1.5 * STEP_S)
    assert late[0] == pytest.approx(AHEAD * HOST_S + 1.5 * STEP_S) and late[1:] == pytest.approx(quiet[1:])
    longer = run(3 * STEP_S)  # longer than the steps in flight: the device waits for the next launch
    assert longer[-1] > quiet[-1]


def test_a_passs_first_decode_step_runs_right_behind_its_prefill_step_on_an_asynchronous_runner():
    """EngineTimer.prefill launches the pass's first decode step before it reads the prefill step's end: the host's
    work for that launch (here HOST_S a launch) overlaps the prefill step, so the decode step lasts its device time.
    A synchronous runner launches it after the end is read, and the step holds that work."""
    from servecap.core.config import ServingConfig
    from servecap.core.recorder import Recorder
    from servecap.costs.model import CostModel
    from servecap.engine.serve import serve
    from servecap.traces.records import RunWriter
    from servecap.traces.workload import poisson_trace

    from helpers import CostRunner, linear_table

    def after_prefill(asynchronous: bool):
        cost, clock = CostModel(linear_table()), VirtualClock()
        runner = CostRunner(cost, clock, 2000, asynchronous)
        launch = runner.launch_decode

        def launch_decode(rows, backend):
            clock.t += HOST_S
            launch(rows, backend)
        runner.launch_decode = launch_decode
        writer = RunWriter(None, {})
        serve(poisson_trace(rate=40, n=60, seed=5), runner, Recorder(writer, "paged"),
              ServingConfig(max_batch=8, prefill="chunked:128"), 2000, clock=clock)
        steps = writer.record().steps
        first = steps[(steps.kind == "decode") & (steps.kind.shift(1) == "prefill")]
        price = [cost.decode("paged", r.rows, r.kv_tokens, r.kv_max) for r in first.itertuples()]
        return (first.end - first.start).to_numpy(), price

    behind, price = after_prefill(True)
    assert len(behind) > 20 and behind == pytest.approx(price, abs=1e-12)
    after, price = after_prefill(False)
    assert after == pytest.approx([p + HOST_S for p in price], abs=1e-12)
