"""scripts/stretch_end_residuals.py: what a decode step holds by its place in its stretch."""
import pytest
from helpers import sim_config
from test_stretch_end import COST, ENDS

from servecap.costs.model import CostModel
from servecap.costs.synthetic import linear_table
from servecap.sim.simulator import simulate
from servecap.traces.workload import poisson_trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_simulated_run_shows_the_ends_it_was_simulated_with_and_nothing_elsewhere(script):
    """Simulated with known stretch ends and no factors, the steps inside a stretch are at their price, so each
    ending step holds its length's end, and the step before the last and a first step after a prefill hold 0."""
    residuals = script("stretch_end_residuals")
    rec = simulate(poisson_trace(8.0, 600, 7), COST, sim_config(detail="steps", max_batch=8, pool_blocks=200)).record
    df = residuals.classify(rec, CostModel(linear_table()))
    by_length = df[df.group == "ends a stretch, by its steps"].groupby("cls").extra_ms.mean()
    assert len(by_length) >= 4
    for cls, ms in by_length.items():
        lo = int(cls.split("-")[0].rstrip("+"))
        truth = ENDS["decode paged padded|s1-2"] if lo <= 2 else ENDS["decode paged padded|s3-4"] if lo <= 4 \
            else ENDS["decode paged padded"]
        assert ms == pytest.approx(1e3 * truth, abs=1e-6), cls
    for group, cls in (("the step before the last", "stretches of 3 or more"),
                       ("a stretch's first step, by the step before it", "prefill")):
        held = df[(df.group == group) & (df.cls == cls)].extra_ms
        assert len(held) > 10 and held.abs().max() < 1e-6, (group, cls)


def test_the_committed_runs_are_read_and_a_bad_path_is_one_line(script, capsys, tmp_path):
    residuals = script("stretch_end_residuals")
    assert residuals.main(["--table", "results/calibration/t10/h200-t10-v26.json",
                           "results/validation-v26-b04010c1/real"]) == 0
    out = capsys.readouterr().out
    assert "ends a stretch, by its steps:" in out and "the step before the last:" in out
    assert residuals.main(["--table", "results/calibration/t10/h200-t10-v26.json", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stretch_end_residuals: error:") and "\n" not in err
