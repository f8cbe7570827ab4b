"""`validate real --pending`: which runs of a plan are still to make, on the CPU, for planning a GPU call: a run
counts as made only where its record closed, every repeat of a fresh point gets an engine of its own, shards split
the runs without overlap, and the printed --only makes exactly the runs left."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servecap.validate.cli import main
from servecap.validate.points import load_plan, run_dir, select
from servecap.validate.real import NOTHING_LEFT, pending

PLAN = Path("results/validation-v37")  # a committed plan: 16 fresh points x 3 repeats


@pytest.fixture
def plan_dir(tmp_path) -> Path:
    out = tmp_path / "v"
    out.mkdir()
    shutil.copy(PLAN / "plan.json", out / "plan.json")
    shutil.copytree(PLAN / "traces", out / "traces")
    return out


def _record(d: Path, status: str) -> None:
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"status": status}))


def _runs(engines) -> list[tuple[str, int]]:
    return sorted((p.id, k) for engine in engines for p, k in engine)


def test_every_repeat_is_left_until_its_record_closes(plan_dir):
    _, points, engines = pending(plan_dir)
    assert _runs(engines) == sorted((p.id, k) for p in points for k in range(1, p.repeats + 1))
    first = points[0]
    _record(run_dir(plan_dir, first, 1), "complete")
    _record(run_dir(plan_dir, first, 2), "running")  # an interrupted run is made again
    left = _runs(pending(plan_dir)[2])
    assert (first.id, 1) not in left and (first.id, 2) in left and (first.id, 3) in left
    assert len(left) == sum(p.repeats for p in points) - 1


def test_each_repeat_of_a_fresh_point_is_the_first_thing_its_own_engine_serves(plan_dir):
    _, points, engines = pending(plan_dir)
    assert all(p.fresh for p in points)
    assert all(len(engine) == 1 for engine in engines)


def test_points_that_need_no_fresh_engine_ride_after_a_fresh_run_once_each(tmp_path):
    out = tmp_path / "v4"
    out.mkdir()
    shutil.copy(Path("results/validation-v4/plan.json"), out / "plan.json")  # two closed points, not fresh
    shutil.copytree(Path("results/validation-v4/traces"), out / "traces")
    _, points, engines = pending(out)
    assert {p.fresh for p in points} == {True, False}
    runs = _runs(engines)
    assert runs == sorted((p.id, k) for p in points for k in range(1, p.repeats + 1))
    assert len(engines) == sum(p.repeats for p in points if p.fresh)
    assert all(engine[0][0].fresh and all(not p.fresh for p, _ in engine[1:]) for engine in engines)


def test_shards_split_the_runs_left_without_overlap(plan_dir):
    everything = _runs(pending(plan_dir)[2])
    shares = [_runs(pending(plan_dir, shard=(i, 3))[2]) for i in range(3)]
    assert sorted(r for s in shares for r in s) == everything
    assert all(s for s in shares)


def test_the_printed_only_makes_exactly_the_runs_left(plan_dir, capsys):
    _, points, _ = pending(plan_dir)
    for p in points[1:]:
        for k in range(1, p.repeats + 1):
            _record(run_dir(plan_dir, p, k), "complete")
    _record(run_dir(plan_dir, points[0], 3), "complete")
    assert main(["real", "--out", str(plan_dir), "--pending"]) == 0
    lines = capsys.readouterr().out.splitlines()
    total = sum(p.repeats for p in points)
    assert lines[0].startswith(f"{total - 2} of {total} runs made; 2 left on 2 engine(s)")
    assert lines[1].split() == [points[0].id, "run", "1,", "2"]
    only = lines[-1].removeprefix("--only ").split(",")
    chosen, _ = select(points, only)
    assert [p.id for p in chosen] == [points[0].id]
    _record(run_dir(plan_dir, points[0], 1), "complete")
    _record(run_dir(plan_dir, points[0], 2), "complete")
    assert main(["real", "--out", str(plan_dir), "--pending"]) == 0
    assert capsys.readouterr().out.strip() == NOTHING_LEFT


def test_pending_with_fleet_or_without_a_plan_is_one_line(plan_dir, tmp_path, capsys):
    assert main(["real", "--out", str(plan_dir), "--pending", "--fleet", "cuda:0,cuda:1"]) == 2
    assert main(["real", "--out", str(tmp_path / "none"), "--pending"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--fleet" in err[0] and "no validation plan" in err[1]


def test_each_share_runs_its_engines_in_plan_order(plan_dir):
    # Shares are balanced longest first, but a call cut short must have made the plan's first points.
    _, points = load_plan(plan_dir)
    order = {p.id: i for i, p in enumerate(points)}
    assert [order[e[0][0].id] for e in pending(plan_dir)[2]] == [i for i in range(len(points)) for _ in range(3)]
    assert [p.id for p in points] == [p.id for p in pending(plan_dir, only=[p.id for p in reversed(points)])[1]]
    for i in range(3):
        firsts = [order[e[0][0].id] for e in pending(plan_dir, shard=(i, 3))[2]]
        assert firsts == sorted(firsts) and len(set(firsts)) < len(firsts)  # three repeats' engines per point
