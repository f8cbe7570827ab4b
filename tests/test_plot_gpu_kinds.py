"""scripts/plot_gpu_kinds.py on v27's points run on an H200 and on an H100: what it gathers from each directory, the
figure, and its refusals."""
import csv

import pytest

H200, H100 = "results/validation-v27-778ea5af", "results/validation-v27-5a57657f"


def test_each_directory_gives_its_gpu_every_planned_point_and_the_measured_ones_where_run(script):
    from pathlib import Path
    gathered = script("plot_gpu_kinds").gathered
    gpu, rows = gathered(Path(H200))
    assert gpu == "NVIDIA H200" and len(rows) == 16  # every point of the plan, predicted
    run = [r for r in rows if r["served_real"] is not None]
    assert len(run) == 7  # the near points that session ran
    with open(f"{H200}/points.csv", newline="") as f:
        real = {r["point"]: float(r["served_rate_real"]) for r in csv.DictReader(f)}
    assert sorted(r["served_real"] for r in run) == sorted(real.values())
    assert {r["policy"] for r in rows} == {"padded", "packed", "chunked", "mixed"}
    gpu, rows = gathered(Path(H100))
    assert gpu == "NVIDIA H100 80GB HBM3" and all(r["served_real"] is not None for r in rows)


def test_the_figure_is_written_once_and_a_directory_without_its_report_is_refused(script, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = script("plot_gpu_kinds")
    out = tmp_path / "kinds.png"
    assert plot.main([H200, H100, "--out", str(out)]) == 0 and out.stat().st_size > 10_000
    assert "7 of 16 points run" in capsys.readouterr().out
    assert plot.main([H200, "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert plot.main(["results/validation-v28", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no points.csv" in err
