"""scripts/plot_gpu_pool.py on two committed GPUs' runs of validation v39's plan."""
from pathlib import Path

import pytest

RUNS = (Path("results/validation-v39-cc7f0c14"), Path("results/validation-v39-93b9ceef"))


def test_each_gpus_points_are_its_grade_and_the_summary_orders_gpus_by_prompt_speed(tmp_path, script):
    plot = script("plot_gpu_pool")
    grades = {v.name: plot.gpu_grade(v) for v in RUNS}
    for v in RUNS:
        graded = [line.split() for line in (v / "grade.txt").read_text().splitlines() if line.endswith((" ok", " MISS"))]
        points = grades[v.name]["points"]
        assert [p[1] for p in points] == [g[0] for g in graded]
        assert [f"{p[2]:+.1%}" for p in points] == [g[2] for g in graded]  # served error, as the committed grade
        assert [p[5] for p in points] == [g[-1] == "ok" for g in graded]
        assert {p[0] for p in points} <= {"near", "past"}
        first = (v / "grade.txt").read_text().splitlines()
        inside = next(line for line in first if line.startswith("  90% bands, public points"))
        assert f"{grades[v.name]['inside']} of {grades[v.name]['graded']} inside" in inside
    lines = plot.summary(grades)
    assert [line.split()[0] for line in lines[1:3]] == sorted(grades, key=lambda v: grades[v]["prompt"])
    assert grades["validation-v39-cc7f0c14"]["prompt"] > 1.01  # the slow-prompt GPU its README section names
    assert "-        +1.0%" in lines[2] and "51/63" in lines[2]  # past points alone there: no near TTFT error
    out = tmp_path / "pool.png"
    assert plot.main(["--out", str(out), *map(str, RUNS)]) == 0
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("args, says", [(["results/validation-v39"], "holds no plan.json and real/ runs"),
                                        (["nowhere"], "holds no plan.json and real/ runs")])
def test_a_directory_without_runs_or_an_existing_figure_is_refused_in_one_line(capsys, tmp_path, script, args, says):
    plot = script("plot_gpu_pool")
    assert plot.main(["--out", str(tmp_path / "f.png"), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    (tmp_path / "f.png").write_bytes(b"x")
    assert plot.main(["--out", str(tmp_path / "f.png"), str(RUNS[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err
