"""scripts/post_burst_clock.py: the clock a stationarity check leaves a GPU at, the line it is fitted by, and a table
rescaled by what it tells."""
import json
import math
from pathlib import Path

import pytest

CHECK = Path("results/validation-v39-91f89b91/logs/stationary/check.txt")


def test_the_post_burst_clock_is_the_mean_after_the_large_prefill_shapes_alone(script):
    clock, n = script("post_burst_clock").post_burst_clock(CHECK)
    # the check's prefill shapes of 20000 positions or more, three repetitions each (README's check of this GPU)
    shapes = [line for line in CHECK.read_text().splitlines() if "stationarity prefill" in line]
    large = [line for line in shapes if math.prod(int(x) for x in line.split("prefill")[1].split()[:3:2]) >= 20000]
    assert n == 3 * len(large) and 0 < len(large) < len(shapes)
    after = [pair[1] for line in large for pair in json.loads(line[line.index("[["):])]
    assert clock == pytest.approx(sum(after) / len(after)) and 1400 < clock < 1980


def test_a_line_fitted_on_the_clock_tells_the_speed_it_was_drawn_from(script):
    pbc = script("post_burst_clock")
    points = [(f"v{i}", c, math.exp(0.01 - 0.0004 * (c - 1550))) for i, c in enumerate((1500, 1530, 1560, 1590))]
    fit = pbc.fitted(points)
    assert fit["slope_per_mhz"] == pytest.approx(-0.0004) and fit["correlation"] == pytest.approx(-1.0)
    assert fit["residual_rms"] == pytest.approx(0.0, abs=1e-12) and fit["mean_clock_mhz"] == 1545.0
    assert pbc.predicted(fit, 1510) == pytest.approx(math.exp(0.01 - 0.0004 * (1510 - 1550)))


def test_fit_reads_each_sessions_check_and_grade_and_refuses_too_few(tmp_path, script, capsys, monkeypatch):
    pbc = script("post_burst_clock")
    sessions = ["results/validation-v39-91f89b91", "results/validation-v39-1982e955", "results/validation-v39-eb110102"]
    speeds = dict(zip(sessions, (1.02, 1.0, 1.01)))
    monkeypatch.setattr(pbc, "gpu_grade", lambda v: {"prompt": speeds[str(v)]})
    out = tmp_path / "fit.json"
    assert pbc.main(["fit", "--out", str(out), *sessions]) == 0
    fit = json.loads(out.read_text())
    assert [s["prompt_speed"] for s in fit["sessions"]] == [1.02, 1.0, 1.01] and fit["slope_per_mhz"] < 0
    assert fit["sessions"][0]["post_burst_clock_mhz"] == pytest.approx(pbc.post_burst_clock(CHECK)[0])
    assert pbc.main(["fit", "--out", str(out), *sessions]) == 2  # kept without --force
    assert pbc.main(["fit", "--out", str(tmp_path / "two.json"), *sessions[:2]]) == 2
    assert "fit needs three or more" in capsys.readouterr().err
    assert pbc.main(["fit", "--out", str(tmp_path / "x.json"), "results/validation-v39-cc7f0c14"]) == 2  # no check


def test_rescale_scales_the_prompt_prices_by_the_told_speed_and_names_its_source(tmp_path, script, capsys):
    from servecap.costs.model import CostModel
    from servecap.costs.shapes import PrefillShape
    from servecap.costs.table import load_cost_table
    pbc = script("post_burst_clock")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"intercept": 0.01, "slope_per_mhz": -0.0004, "mean_clock_mhz": 1550.0}))
    table, out = Path("results/calibration/h100/h100-t10-v31.json"), tmp_path / "t.json"
    assert pbc.main(["rescale", "--check", str(CHECK), "--fit", str(fit), "--table", str(table), "--out", str(out)]) == 0
    clock = pbc.post_burst_clock(CHECK)[0]
    told = math.exp(0.01 - 0.0004 * (clock - 1550))
    old, new = load_cost_table(table), load_cost_table(out)
    assert new.raw["refreshed_from"]["table_id"] == old.table_id
    assert new.raw["refresh"]["applied"]["prefill"] == pytest.approx(told)
    shape = PrefillShape.padded(8, 1024)
    assert CostModel(new).prefill(shape) == pytest.approx(told * CostModel(old).prefill(shape), rel=0.02)
    decode = [CostModel(t).decode("paged", 8, [8192], [1024]).tolist() for t in (new, old)]
    assert decode[0] == decode[1]  # decode steps are not prompt steps
    bad = tmp_path / "bad.txt"
    bad.write_text("no check here\n")
    assert pbc.main(["rescale", "--check", str(bad), "--fit", str(fit), "--table", str(table),
                     "--out", str(tmp_path / "u.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no stationarity prefill shape" in err
