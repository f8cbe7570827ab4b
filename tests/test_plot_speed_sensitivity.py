"""scripts/plot_speed_sensitivity.py on a committed near-capacity point: the simulator's TTFT p50 over speed, and
each real run at its own speed."""
import shutil

import pytest

TABLE = "results/calibration/t10/h200-t10-v25.json"
V = "results/validation-v26-b04010c1"


def test_the_curve_rises_with_slower_steps_and_each_run_sits_at_its_own_speed(script, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = script("plot_speed_sensitivity")
    v = tmp_path / "v"
    shutil.copytree(V, v, ignore=shutil.ignore_patterns("*.png"))
    for point in (v / "real").iterdir():
        if point.name != "packed-sharegpt-near-41":
            shutil.rmtree(point)
    from servecap.sim.inputs import load_table
    rows = plot.curves([v], load_table(TABLE))
    assert len(rows) == 1 and len(rows[0]["runs"]) == 3
    sim = rows[0]["sim_ms"]
    assert sim[-1] > 3 * sim[0]  # near capacity: 3% slower against 3% faster more than triples TTFT p50
    assert all(0.99 < f < 1.02 for f, _ in rows[0]["runs"])  # these runs: 1.002-1.004 of T10-v25's price
    out = tmp_path / "s.png"
    assert plot.main(["--table", TABLE, "--out", str(out), str(v)]) == 0 and out.stat().st_size > 10_000
    assert plot.main(["--table", TABLE, "--out", str(out), str(v)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
