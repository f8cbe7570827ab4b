"""scripts/targets.py: each GPU kind's pool graded as it is, and the README's table of the targets."""
from pathlib import Path

import pandas as pd


def test_a_kinds_cells_count_each_target_over_its_sessions(script):
    targets, grade = script("targets"), script("grade_validation")

    def session(points, totals, kinds, inside, measured, widths):
        near = {"inside": inside, "graded": measured,
                "width_vs_real_spread": [{"width": w, "real_spread": 1.0} for w in widths]}
        return grade.Graded(pd.DataFrame({"total": totals}), {"all": near, "near": near}, ([], {}), points, kinds)
    a = session([("p", 0.01, 0.2, 0.3, True), ("q", 0.03, 0.0, 0.0, True)], [1.0, 1.03], {"decode": 1.01}, 9, 10,
                [1.5, 3.0])
    b = session([("p", -0.02, -0.2, 0.0, False)], [0.99], {"decode": 0.97, "prefill": 1.0}, 8, 10, [5.0])
    assert targets.column({"a": a, "b": b}) == {
        "served": "2 of 3", "ttft": "2 of 3", "runs": "2 of 3", "kinds": "2 of 3",
        "bands": "17 of 20 (85.0%); sessions under 85%: 1 of 2", "width": "1 of 3 (median 3.0x)",
        "width_gpus": "none run on several GPUs"}
    lines = targets.table({"h100": (2, targets.column({"a": a, "b": b}))})
    assert lines[0] == "| target | H100: 2 sessions |" and lines[1] == "|---|---|"
    assert lines[2] == "| served rate within 2%, every public-trace point | 2 of 3 |" and len(lines) == 2 + 7


def test_the_pools_are_graded_as_they_are_into_files_that_are_not_replaced_without_force(tmp_path, script, capsys,
                                                                                      monkeypatch):
    targets = script("targets")
    monkeypatch.setattr(targets, "POOLS", {"h200": ("v16-71520d56", "v26-b04010c1")})
    assert targets.main(["--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table == (tmp_path / "targets.md").read_text().splitlines()
    graded = (tmp_path / "h200.txt").read_text()
    # v16-71520d56 was planned from a refreshed table: graded against the unrefreshed plan its points came from
    unrefreshed = Path("results/validation-v32/unrefreshed/h200/v16-71520d56.txt").read_text().splitlines()[0]
    assert unrefreshed in graded.splitlines()
    assert "targets over 2 validations: 8 arrival points" in graded
    assert table[0] == "| target | H200: 2 sessions |"
    assert targets.main(["--out", str(tmp_path)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert (tmp_path / "targets.md").read_text().splitlines() == table
