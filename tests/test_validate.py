"""The validation pipeline on the CPU: blind predictions, a plan with its predictions frozen in, stand-in "real"
records (simulator runs with step-time noise, written as the engine writes them), the report and its protocol
checks. A small synthetic Azure-format CSV and ShareGPT-format CSV stand in for the public traces."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servecap.costs.model import CostModel
from servecap.costs.synthetic import linear_table
from servecap.costs.table import save_cost_table
from servecap.sim.fleet import simulate_fleet
from servecap.sim.simulator import SimConfig, simulate
from servecap.traces.errors import InputError
from servecap.traces.provenance import now_iso
from servecap.traces.records import RunWriter
from servecap.validate.cli import main
from servecap.validate.points import build_trace, load_plan, run_dir, select

N = 40


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    save_cost_table({**linear_table(), "created_at": "2026-01-01T00:00:00+00:00"}, d / "table.json")
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.0000000,{50 + 37 * i % 900},{10 + 13 * i % 240}"
             for i in range(120)]
    (d / "azure.csv").write_text("\n".join(rows) + "\n")
    (d / "sharegpt.csv").write_text("num_prefill_tokens,num_decode_tokens\n" +
                                    "".join(f"{30 + 41 * i % 1500},{5 + 17 * i % 300}\n" for i in range(200)))
    return d


def fill_real(out, table, created_at=None, plan_table=None):
    plan, points = load_plan(out)
    cost = CostModel(table)
    for p in points:
        trace = build_trace(p.trace, out)
        for k in range(1, p.repeats + 1):
            cfg = SimConfig(p.serving, noise_seed=k, detail="tokens" if p.tokens else "steps")
            rec = (simulate_fleet(trace, cost, cfg) if p.serving.replicas > 1 else
                   simulate(trace, cost, cfg)).record
            meta = {**rec.meta, "kind": "engine", "device": {"name": "stand-in", "uuid": "GPU-x"},
                    "plan_table_id": plan_table or plan["table"]["id"], "created_at": created_at or now_iso()}
            w = RunWriter(run_dir(out, p, k), meta)
            for t in ("requests", "steps", "tokens", "rejected"):
                w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
            w.close()


@pytest.mark.slow
def test_predict_plan_real_report_end_to_end(inputs, tmp_path, capsys):
    table = inputs / "table.json"
    pred = tmp_path / "predictions"
    assert main(["predict", "--table", str(table), "--azure", str(inputs / "azure.csv"), "--n", str(N),
                 "--out", str(pred)]) == 0
    doc = json.loads((pred / "predictions.json").read_text())
    assert {p["prefill"] for p in doc["points"]} == {"padded", "packed", "chunked:512"}
    assert main(["predict", "--table", str(table), "--azure", str(inputs / "azure.csv"), "--out", str(pred)]) == 2
    assert "already holds predictions" in capsys.readouterr().err

    out = tmp_path / "validation"
    argv = ["plan", "--table", str(table), "--n", str(N), "--azure", str(inputs / "azure.csv"),
            "--sharegpt", str(inputs / "sharegpt.csv"), "--predictions", str(pred), "--out", str(out)]
    assert main(argv) == 0
    plan, points = load_plan(out)
    assert plan["table"]["id"] and set(plan["predictions"]) == {p.id for p in points}
    assert {p.role for p in points} >= {"below", "near", "past", "closed", "public", "policy", "fleet"}
    assert {p.serving.router for p in points if p.role == "fleet"} >= {"round-robin", "least-outstanding"}
    assert all(p.fresh for p in points if p.role == "public")
    assert plan["blind"]["predictions"] == doc["predictions"]  # graded as they were made
    assert main(argv) == 2 and "already holds a validation plan" in capsys.readouterr().err

    from servecap.costs.table import load_cost_table
    fill_real(out, load_cost_table(table))
    assert main(["report", "--out", str(out)]) == 0  # graded against the table its plan names, not the shipped one
    report = (out / "report.md").read_text()
    for target in ("served rate, public traces", "blind prediction, served rate", "capacity bracket",
                   "fleet of two: served rate"):
        assert target in report
    # latencies in ms, as the ecosystem writes them: the points table says its units, and a seconds-scale TTFT
    # (tens of ms at these rates) would print below 1
    assert "| queue p50 (ms) | TTFT p50 (ms) | TTFT p95 (ms) | wall (s) |" in report
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| rate-")]
    assert rows and all(float(r[4].split(" / ")[0]) > 1 for r in rows)
    assert (out / "validation.png").stat().st_size > 20_000
    assert main(["report", "--table", str(table), "--out", str(out)]) == 2  # no silent rewrite


@pytest.mark.slow
def test_a_run_made_before_the_table_or_for_another_plan_is_refused(inputs, tmp_path, capsys):
    table = inputs / "table.json"
    out = tmp_path / "validation"
    assert main(["plan", "--table", str(table), "--n", str(N), "--skip", "public,policies,fleet", "--out", str(out)]) == 0
    from servecap.costs.table import load_cost_table
    fill_real(out, load_cost_table(table), created_at="2020-01-01T00:00:00+00:00")
    with pytest.raises(InputError, match="made before cost table"):
        from servecap.validate.report import compare
        compare(out, table)


def test_a_plan_without_the_public_traces_must_say_so(inputs, tmp_path, capsys):
    assert main(["plan", "--table", str(inputs / "table.json"), "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "need --azure PATH and --sharegpt PATH" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_plan_on_an_earlier_plans_points_is_graded_on_the_runs_made_under_that_one(inputs, tmp_path, capsys):
    from servecap.costs.table import load_cost_table
    from servecap.validate.report import compare
    table, first, second = inputs / "table.json", tmp_path / "blind", tmp_path / "recalibrated"
    other = tmp_path / "other.json"
    save_cost_table({**linear_table(retire_s=0.004), "created_at": "2026-01-02T00:00:00+00:00"}, other)
    base = ["plan", "--n", str(N), "--azure", str(inputs / "azure.csv"), "--sharegpt", str(inputs / "sharegpt.csv")]
    assert main([*base, "--table", str(table), "--skip", "curve,closed,policies,fleet", "--out", str(first)]) == 0
    assert main(["plan", "--table", str(other), "--points-from", str(first), "--mechanisms", "mixed",
                 "--out", str(second)]) == 2
    assert "--mechanisms would choose others" in capsys.readouterr().err
    assert main(["plan", "--table", str(other), "--points-from", str(first), "--cost-draws", "apart",
                 "--out", str(second)]) == 2
    assert "--cost-draws apart draws the bands' costs: it needs --interval" in capsys.readouterr().err
    assert main(["plan", "--table", str(other), "--points-from", str(first), "--out", str(second)]) == 0
    apart = tmp_path / "apart"
    assert main(["plan", "--table", str(other), "--points-from", str(first), "--interval", "90", "--cost-draws",
                 "apart", "--out", str(apart)]) == 0
    intervals = load_plan(apart)[0]["intervals"]
    assert "apart" in intervals and set(intervals["bands"]) == {p.id for p in load_plan(first)[1]}
    (p1, pts1), (p2, pts2) = load_plan(first), load_plan(second)
    assert [p.to_json() for p in pts1] == [p.to_json() for p in pts2] and pts2
    assert p2["points_from"]["table_id"] == p1["table"]["id"] != p2["table"]["id"]
    assert p2["predictions"] != p1["predictions"]  # its own table's
    fill_real(first, load_cost_table(table))
    (second / "real").symlink_to(first / "real")
    _, graded = compare(second, other)
    assert len(graded) == len(pts2)
    # ...and the earlier plan on the runs made under the later one, which took its points from it
    sibling, another = tmp_path / "sibling", tmp_path / "another.json"
    save_cost_table({**linear_table(retire_s=0.006), "created_at": "2026-01-02T00:00:00+00:00"}, another)
    assert main(["plan", "--table", str(another), "--points-from", str(first), "--out", str(sibling)]) == 0
    (second / "real").unlink()
    shutil.rmtree(first / "real")
    fill_real(second, load_cost_table(table))
    (first / "real").symlink_to(second / "real")
    _, graded = compare(first, table)
    assert len(graded) == len(pts1)
    (sibling / "real").mkdir()  # ...and another plan on the first one's points, on them too, linked point by point
    for d in (second / "real").iterdir():
        (sibling / "real" / d.name).symlink_to(d)
    _, graded = compare(sibling, another)
    assert len(graded) == len(pts1)
    third = tmp_path / "third"  # runs planned against neither table are refused
    assert main(["plan", "--table", str(other), "--points-from", str(first), "--out", str(third)]) == 0
    fill_real(third, load_cost_table(table), plan_table="0" * 16)
    with pytest.raises(InputError, match="planned against cost table"):
        compare(third, other)


def test_a_plan_keeps_only_the_points_it_is_told_and_names_the_ones_it_left_out(inputs, tmp_path, capsys):
    base = ["plan", "--n", str(N), "--azure", str(inputs / "azure.csv"), "--sharegpt", str(inputs / "sharegpt.csv"),
            "--table", str(inputs / "table.json"), "--skip", "curve,closed,policies,fleet,public-below"]
    assert main([*base, "--only", "azure-conv-near,nowhere", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--only names point(s) the plan does not have: nowhere" in err and err.count("\n") == 1
    assert not (tmp_path / "bad" / "plan.json").exists()
    assert main([*base, "--only", "azure-conv-near,sharegpt-past", "--out", str(tmp_path / "v")]) == 0
    plan, points = load_plan(tmp_path / "v")
    assert [p.id.rsplit("-", 1)[0] for p in points] == ["azure-conv-near", "sharegpt-past"]
    assert sorted(plan["predictions"]) == [p.id for p in points]
    assert [i.rsplit("-", 1)[0] for i in plan["left_out"]] == ["azure-conv-past", "sharegpt-near"]
    # the real runs take the same names: with or without the rate, and a name the plan lacks is refused at once
    kept, rest = select(points, ["sharegpt-past", points[0].id])
    assert [p.id for p in kept] == [p.id for p in points] and rest == []
    assert [p.id for p in select(points, ["sharegpt-past"])[0]] == [points[1].id]
    assert main(["real", "--out", str(tmp_path / "v"), "--only", "sharegpt-past,nowhere"]) == 2
    err = capsys.readouterr().err
    assert "--only names point(s) the plan does not have: nowhere" in err and err.count("\n") == 1
    assert not (tmp_path / "v" / "real").exists()
    # its report grades the targets it has points for, and names the others in one line, not as "0 of 0" rows
    from servecap.costs.table import load_cost_table
    fill_real(tmp_path / "v", load_cost_table(inputs / "table.json"))
    assert main(["report", "--table", str(inputs / "table.json"), "--out", str(tmp_path / "v")]) == 0
    report = (tmp_path / "v" / "report.md").read_text()
    assert "| served rate, public traces (first pass of a fresh engine) | " in report and "| 0 of 0 |" not in report
    skipped = next(line for line in report.splitlines() if line.startswith("Not graded here"))
    assert "fleet of two: served rate" in skipped and "served rate, public traces" not in skipped


def test_a_report_grades_the_repeats_that_completed_when_a_run_was_cut_off(inputs, tmp_path):
    import csv
    import shutil

    from servecap.costs.table import load_cost_table
    from servecap.validate.report import write_report
    table, out = inputs / "table.json", tmp_path / "v"
    assert main(["plan", "--table", str(table), "--n", str(N), "--skip", "public,policies,fleet,closed",
                 "--out", str(out)]) == 0
    fill_real(out, load_cost_table(table))
    near = next(p for p in load_plan(out)[1] if p.repeats > 1)
    shutil.rmtree(run_dir(out, near, 2))  # the call's time ran out before this repeat: its record was discarded
    write_report(out, table)
    with open(out / "points.csv") as f:
        repeats = {r["point"]: int(r["repeats"]) for r in csv.DictReader(f)}
    assert repeats[near.id] == 1


def test_the_azure_points_can_replay_a_later_window_of_the_trace(tmp_path):
    from servecap.validate.plan import PUBLIC_CAPS, _azure_window
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    # one row a second; every fifth prompt is longer than the validation serves
    rows += [f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.5000000,{5000 if i % 5 == 4 else 100 + i},{300 + i}"
             for i in range(100)]
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(rows) + "\n")
    first = _azure_window(path, 10)
    assert [r.prompt_tokens for r in first.requests] == [100 + i for i in range(12) if i % 5 != 4]
    later = _azure_window(path, 10, start_s=30.0)
    # the first row at or after 30 s on the file's own clock is row 30; the longer prompts are left out
    assert [r.prompt_tokens for r in later.requests] == [100 + i for i in range(30, 42) if i % 5 != 4]
    assert later.requests[0].arrival == 0.0 and later.requests[-1].arrival == pytest.approx(11.0)
    assert all(r.budget == PUBLIC_CAPS.max_budget for r in later.requests)
    with pytest.raises(InputError, match="fewer than the 10"):
        _azure_window(path, 10, start_s=90.0)


def test_plan_azure_from_is_recorded_in_the_points_traces(inputs, tmp_path):
    out = tmp_path / "plan"
    assert main(["plan", "--table", str(inputs / "table.json"), "--out", str(out), "--n", str(N),
                 "--azure", str(inputs / "azure.csv"), "--sharegpt", str(inputs / "sharegpt.csv"),
                 "--skip", "curve,closed,policies,fleet,public-below", "--azure-from", "20"]) == 0
    _, points = load_plan(out)
    azure = [p for p in points if p.id.startswith("azure-conv")]
    assert azure and all(build_trace(p.trace, out).meta["options"]["window"][0] == 20 for p in azure)


def test_a_plans_table_is_found_by_its_id_when_its_gpu_refreshed_the_table_twice_under_one_name(monkeypatch):
    from servecap.validate.comparison import plan_table
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the plans name their tables from the root
    # v20's calls b and c ran on one GPU: both refreshes wrote h200-t10-v19-673ad031.json there; call c's is kept
    # beside call b's with a suffix, and each plan names the path and its own id
    first, second = Path("results/validation-v20-673ad031"), Path("results/validation-v20-673ad031c")
    assert plan_table(first) == Path("results/calibration/t10/h200-t10-v19-673ad031.json")
    assert plan_table(second) == Path("results/calibration/t10/h200-t10-v19-673ad031c.json")


def test_a_plans_table_that_is_nowhere_is_left_for_compare_to_name(tmp_path):
    from servecap.validate.comparison import plan_table
    (tmp_path / "plan.json").write_text(json.dumps({"table": {"id": "0" * 16, "path": str(tmp_path / "t.json")}}))
    (tmp_path / "t.json").write_text(json.dumps({"table_id": "1" * 16}))
    (tmp_path / "t-other.json").write_text(json.dumps({"table_id": "2" * 16}))
    assert plan_table(tmp_path) == tmp_path / "t.json"


def test_replay_reproduces_each_real_run_and_keeps_what_it_wrote(inputs, tmp_path, capsys):
    """`validate replay`: every complete run of the plan's points through the scheduler at its recorded step times,
    one line a run; written once (--force to replace); a directory without a plan is one line and exit 2."""
    from servecap.costs.table import load_cost_table
    out = tmp_path / "v"
    assert main(["plan", "--n", str(N), "--azure", str(inputs / "azure.csv"), "--sharegpt", str(inputs / "sharegpt.csv"),
                 "--table", str(inputs / "table.json"), "--skip", "curve,closed,policies,fleet,public-below",
                 "--only", "azure-conv-near,sharegpt-past", "--repeats", "2", "--out", str(out)]) == 0
    fill_real(out, load_cost_table(inputs / "table.json"))  # the simulator's runs with seeded step noise
    capsys.readouterr()
    assert main(["replay", "--out", str(out)]) == 0
    assert "4 of 4 runs identical" in capsys.readouterr().out
    doc = json.loads((out / "replay.json").read_text())
    assert doc["identical"] == doc["runs"] == 4 and doc["git_commit"]
    assert "| azure-conv-near-" in (out / "replay.md").read_text()
    assert main(["replay", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds replay.md, replay.json" in err and err.count("\n") == 1
    assert main(["replay", "--out", str(out), "--only", "sharegpt-past", "--force"]) == 0
    assert "2 of 2 runs identical" in capsys.readouterr().out
    assert main(["replay", "--out", str(out), "--only", "nowhere", "--force"]) == 2
    assert "--only names point(s) the plan does not have: nowhere" in capsys.readouterr().err
    assert main(["replay", "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no validation plan here" in err and err.count("\n") == 1
