"""scripts/plot_workflow.py on a committed validation: each point's prediction and band over its real runs' mean."""
from pathlib import Path

import numpy as np
import pytest


def test_the_workflow_figure_puts_each_blind_prediction_and_band_over_its_real_runs_mean(tmp_path, script):
    pytest.importorskip("matplotlib")
    plot = script("plot_workflow")
    rows = plot.points([Path("results/validation-v16-71520d56")])
    assert [r["label"] for r in rows] == ["v16 71520d56 sharegpt-past-56", "v16 71520d56 chunked512-sharegpt-past-47"]
    for r in rows:
        for k in ("served_rate", "ttft_p50"):
            assert len(r[k]["real"]) == 3 and abs(np.mean(r[k]["real"])) < 1e-12
            assert r[k]["lo"] <= r[k]["pred"] <= r[k]["hi"]
    # grade.txt of that validation: served +0.9% and +0.4%, TTFT p50 -4.9% and -0.8%
    assert [round(r["served_rate"]["pred"] * 100, 1) for r in rows] == [0.9, 0.4]
    assert [round(r["ttft_p50"]["pred"] * 100, 1) for r in rows] == [-4.9, -0.8]
    out = tmp_path / "w.png"
    plot.plot(rows, out)
    assert out.stat().st_size > 10_000
