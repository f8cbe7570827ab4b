"""scripts/plot_refresh_choice.py on a committed refreshed validation and the unrefreshed plan it was made from."""
from pathlib import Path


def test_each_plans_errors_are_the_grades_and_the_figure_is_written(capsys, tmp_path, script):
    plot = script("plot_refresh_choice")
    runs = Path("results/validation-v16-71520d56")
    errors = plot.errors(runs, {"unrefreshed": Path("results/validation-v16"), "closed": runs})
    graded = [line for line in (runs / "grade.txt").read_text().splitlines() if line.endswith((" ok", " MISS"))]
    assert [t[0] for t in errors["closed"]] == [t[0] for t in errors["unrefreshed"]] == [g.split()[0] for g in graded]
    # its own plan's TTFT errors are the committed grade's; the unrefreshed plan predicts otherwise
    assert [f"{t[2]:+.1%}" for t in errors["closed"]] == [g.split("TTFT p50 ")[1].split()[0] for g in graded]
    assert [t[2] for t in errors["unrefreshed"]] != [t[2] for t in errors["closed"]]
    out = tmp_path / "fig.png"
    assert plot.main(["--out", str(out), "--session", str(runs), "unrefreshed=results/validation-v16",
                      f"closed={runs}"]) == 0
    assert out.stat().st_size > 10_000


def test_a_session_without_plans_or_an_existing_figure_is_refused_in_one_line(capsys, tmp_path, script):
    plot = script("plot_refresh_choice")
    assert plot.main(["--out", str(tmp_path / "f.png"), "--session", "results/validation-v16-71520d56"]) == 2
    assert "give LABEL=PLAN_DIR" in capsys.readouterr().err
    (tmp_path / "f.png").write_bytes(b"x")
    assert plot.main(["--out", str(tmp_path / "f.png"), "--session", "results/validation-v16-71520d56",
                      "u=results/validation-v16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err
