"""Regression tests for the reliability audit's data defects (issue 26: L1-L6 lose or overwrite data without --force,
S1-S7 give silent wrong answers), each built from its script in ../shared/audits/reliability/."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from helpers import linear_table, run_cli, write_table

import servecap.calibrate.cli

from servecap import calibrate
import servecap.engine.cli
from servecap import engine
import servecap.sim.cli
from servecap import sim
import servecap.traces.cli
from servecap import traces
import servecap.validate.cli
from servecap import validate
from servecap.sim.store import FILE
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.records import read_run
from servecap.traces.trace_io import read_trace, write_trace
from servecap.traces.workload import Request, Trace

REPO = Path(__file__).resolve().parents[1]
T2 = REPO / "results/calibration/t2/h200-t2.json"  # the table the committed validation was planned from
HEADER = '# {"meta": {}, "schema": "request-trace", "version": 1}\nrequest_id,arrival_s,prompt_tokens,budget,prompt\n'


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


@pytest.fixture
def no_engine(monkeypatch):
    """Refusals of engine run come before the model loads: starting it fails the test (and keeps it fast)."""
    monkeypatch.setattr(engine.cli, "build_engine", lambda args: pytest.fail("the engine was started"))


def refused(code: int, err: str, *words: str) -> str:
    """Exit status 2 and a one-line reason on stderr holding `words`, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


def _trace(path: Path, rows: str) -> Path:
    path.write_text(HEADER + rows)
    return path


def _record(capsys, table: Path, out: Path) -> Path:
    assert run_cli(sim.cli.main, capsys, "run", "--rate", "5", "--n", "20", "--table", table, "--out", out)[0] == 0
    return out


# --- L1: --trace-events writes over nothing it should not --------------------------------------------------

def test_sim_run_trace_events_never_replaces_the_input_trace_or_the_record_it_writes(capsys, table, tmp_path):
    trace = write_trace(Trace([Request(i, 0.2 * i, 16, 4) for i in range(20)]), tmp_path / "trace.csv")
    kept = trace.read_bytes()
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--trace", trace, "--trace-events", trace, "--table", table)
    refused(code, err, str(trace), "the input trace (--trace)")
    # --force is no licence to destroy an input
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--trace", trace, "--trace-events", trace, "--table", table,
                           "--force")
    refused(code, err, "the input trace")
    assert trace.read_bytes() == kept
    rec = tmp_path / "rec"
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--rate", "5", "--n", "20", "--table", table, "--out", rec,
                           "--trace-events", rec / "steps.csv")
    refused(code, err, "the run record (--out)")
    assert not rec.exists()  # refused before the run: nothing written


def test_sim_run_trace_events_replaces_an_existing_file_only_with_force(capsys, table, tmp_path):
    events = tmp_path / "events.json"
    events.write_text("someone's timeline\n")
    argv = ["run", "--rate", "5", "--n", "20", "--table", table, "--trace-events", events]
    refused(*run_cli(sim.cli.main, capsys, *argv)[::2], str(events), "--force")
    assert events.read_text() == "someone's timeline\n"
    assert run_cli(sim.cli.main, capsys, *argv, "--force")[0] == 0
    assert "traceEvents" in json.loads(events.read_text())


def test_engine_run_trace_events_never_replaces_its_input_trace(capsys, no_engine, tmp_path):
    trace = _trace(tmp_path / "tiny.csv", "0,0.0,16,4,\n")
    code, _, err = run_cli(engine.cli.main, capsys, "run", "--device", "cpu", "--model", "tiny", "--trace", trace,
                           "--trace-events", trace)
    refused(code, err, "the input trace (--trace)")
    assert trace.read_text() == HEADER + "0,0.0,16,4,\n"


# --- L2: timeline --out and explain --png ---------------------------------------------------------------

def test_timeline_out_never_replaces_the_record_it_reads_and_an_existing_file_only_with_force(capsys, table,
                                                                                              tmp_path):
    rec = _record(capsys, table, tmp_path / "rec")
    meta = (rec / "meta.json").read_bytes()
    code, _, err = run_cli(traces.cli.main, capsys, "timeline", rec, "--out", rec / "meta.json")
    refused(code, err, "the run record", "it reads")
    code, _, err = run_cli(traces.cli.main, capsys, "timeline", rec, "--out", rec / "meta.json", "--force")
    refused(code, err, "the run record")
    assert (rec / "meta.json").read_bytes() == meta and read_run(rec).meta["status"] == "complete"
    out = tmp_path / "t.json"
    out.write_text("precious\n")
    refused(*run_cli(traces.cli.main, capsys, "timeline", rec, "--out", out)[::2], "--force")
    assert out.read_text() == "precious\n"
    assert run_cli(traces.cli.main, capsys, "timeline", rec, "--out", out, "--force")[0] == 0
    assert "traceEvents" in json.loads(out.read_text())


def test_explain_png_replaces_an_existing_file_only_with_force_and_never_one_in_the_record(capsys, table,
                                                                                          tmp_path):
    rec = _record(capsys, table, tmp_path / "rec")
    png = tmp_path / "keep.png"
    png.write_text("precious\n")
    refused(*run_cli(traces.cli.main, capsys, "explain", rec, "--png", png)[::2], str(png), "--force")
    assert png.read_text() == "precious\n"
    refused(*run_cli(traces.cli.main, capsys, "explain", rec, "--png", rec / "steps.csv", "--force")[::2],
            "the run record")
    assert len(read_run(rec).steps) > 0
    assert run_cli(traces.cli.main, capsys, "explain", rec, "--png", png, "--force")[0] == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- L3: validate sag --compare -------------------------------------------------------------------------

def test_sag_compare_replaces_an_existing_comparison_only_with_force(capsys, tmp_path):
    """Only the sag points' real runs are copied, so the old behaviour (grade, then overwrite) runs in seconds."""
    val, out = tmp_path / "validation", tmp_path / "sag"
    (val / "real").mkdir(parents=True)
    shutil.copy(REPO / "results/validation/plan.json", val)
    for d in (REPO / "results/validation/real").glob("sag-*"):
        shutil.copytree(d, val / "real" / d.name)
    out.mkdir()
    shutil.copy(REPO / "results/sag/search.json", out)
    (out / "comparison.md").write_text("committed\n")
    code, _, err = run_cli(validate.cli.main, capsys, "sag", "--compare", val, "--out", out, "--table", T2,
                           "--allow-nonstationary")
    refused(code, err, "comparison.md", "--force")
    assert (out / "comparison.md").read_text() == "committed\n" and not (out / "comparison.png").exists()


# --- L4: a resume after a cut-off last line -------------------------------------------------------------

SWEEP = ["sweep", "--rates", "1,2,4,6", "--max-batch", "8", "--pool-gib", "0.5,2", "--backend", "paged",
         "--n", "40", "--jobs", "1"]


def test_a_resume_after_a_cut_off_last_line_leaves_a_points_file_the_next_resume_reads(capsys, table, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_cli(sim.cli.main, capsys, *SWEEP, "--table", table, "--out", whole)[0] == 0
    lines = (whole / FILE).read_text().splitlines(keepends=True)
    cut.mkdir()
    (cut / FILE).write_text("".join(lines[:4]) + lines[4][:30])  # killed mid-write of the fourth point
    assert run_cli(sim.cli.main, capsys, *SWEEP, "--table", table, "--out", cut, "--resume")[0] == 0
    for line in (cut / FILE).read_text().splitlines():
        json.loads(line)  # every line whole: the fragment is gone
    code, _, err = run_cli(sim.cli.main, capsys, *SWEEP, "--table", table, "--out", cut, "--resume")
    assert code == 0, err
    assert (cut / "sweep.csv").read_bytes() == (whole / "sweep.csv").read_bytes()


# --- L5: one sweep at a time on one --out ---------------------------------------------------------------

def test_a_second_sweep_on_the_out_of_a_running_one_is_refused(capsys, table, tmp_path):
    out = tmp_path / "sw"
    first = ["sweep", "--rates", ",".join(str(r) for r in range(1, 41)), "--max-batch", "8", "--pool-gib", "2",
             "--backend", "paged", "--n", "1500", "--jobs", "1", "--table", str(table), "--out", str(out)]
    a = subprocess.Popen([sys.executable, "-m", "sim", *first], cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not ((out / FILE).exists() and (out / FILE).read_text().count("\n") >= 2):
            assert a.poll() is None and time.monotonic() < deadline, "the first sweep ended before the second began"
            time.sleep(0.1)
        code, _, err = run_cli(sim.cli.main, capsys, "sweep", "--rates", "10,20", "--max-batch", "8", "--pool-gib",
                               "1", "--backend", "paged", "--n", "40", "--table", table, "--out", out, "--force")
        assert a.poll() is None, "the first sweep ended before the second was refused"
        refused(code, err, str(out), "another sweep", "still running")
    finally:
        _, a_err = a.communicate(timeout=600)
    assert a.returncode == 0, a_err
    points = (out / FILE).read_bytes()
    assert b"\0" not in points and json.loads(points.splitlines()[0])["setup"]["rates"] == list(range(1, 41))
    assert len(points.splitlines()) == 1 + 40  # every point of the first sweep, none of the second's


# --- L6: --force replaces only a regular file -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_force_never_replaces_a_symlink_or_a_special_file(capsys, tmp_path, kind):
    target, out = tmp_path / "target.csv", tmp_path / "out.csv"
    target.write_text("someone's file\n")
    out.symlink_to(target) if kind == "symlink" else os.mkfifo(out)
    code, _, err = run_cli(traces.cli.main, capsys, "poisson", "--rate", "2", "--n", "5", "--out", out, "--force")
    refused(code, err, str(out), "only a regular file is ever replaced")
    assert (out.is_symlink() if kind == "symlink" else out.is_fifo()) and target.read_text() == "someone's file\n"
    with pytest.raises(InputError, match="only a regular file"):
        atomic_write_text(out, "text\n")
    assert out.is_symlink() if kind == "symlink" else out.is_fifo()


def test_calibrate_force_never_replaces_a_symlink_and_says_so_before_the_engine(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("servecap.engine.engine.Engine", lambda cfg: pytest.fail("the engine was started"))
    out = tmp_path / "table.json"
    out.symlink_to(tmp_path / "elsewhere.json")
    code, _, err = run_cli(calibrate.cli.main, capsys, "--device", "cpu", "--model", "tiny", "--quick", "--out", out,
                           "--force")
    refused(code, err, str(out), "is a symlink")
    assert out.is_symlink()


# --- S1: validate report and runs made before the plan --------------------------------------------------

def test_report_refuses_a_real_run_made_before_the_plan(tmp_path):
    """The committed validation's first point, its run dated after table T2 (23:01:31) but before the plan (23:02:40):
    a run of an earlier plan kept after `validate plan --force`."""
    from servecap.validate.report import compare
    plan = json.loads((REPO / "results/validation/plan.json").read_text())
    first = plan["points"][0]["id"]
    shutil.copy(REPO / "results/validation/plan.json", tmp_path)
    shutil.copytree(REPO / "results/validation/real" / first, tmp_path / "real" / first)
    meta = tmp_path / "real" / first / "run-1" / "meta.json"
    m = json.loads(meta.read_text())
    assert m["created_at"] > plan["created_at"]  # as committed: after the plan
    meta.write_text(json.dumps({**m, "created_at": "2026-11-30T23:02:00+00:00"}))
    with warnings.catch_warnings(), pytest.raises(InputError, match=f"point {first}: a real run .* before the plan"):
        warnings.simplefilter("ignore")  # the points without runs here
        compare(tmp_path, T2, allow_nonstationary=True)


# --- S2: request ids are exact -------------------------------------------------------------------------

def test_request_ids_above_2_to_the_53_keep_every_digit(capsys, table, tmp_path):
    big = _trace(tmp_path / "id64.csv", "1234567890123456789,0.1,16,8,\n")
    assert read_trace(big).requests[0].request_id == 1234567890123456789
    assert run_cli(sim.cli.main, capsys, "run", "--trace", big, "--table", table, "--out", tmp_path / "rec")[0] == 0
    assert (tmp_path / "rec/requests.csv").read_text().splitlines()[1].split(",")[0] == "1234567890123456789"
    near = _trace(tmp_path / "ids.csv", "9007199254740993,0.1,16,8,\n9007199254740992,0.2,16,8,\n")
    assert [r.request_id for r in read_trace(near).requests] == [9007199254740993, 9007199254740992]
    assert read_trace(_trace(tmp_path / "f.csv", "1.2e1,0.1,16.0,8,\n")).requests[0].request_id == 12
    with pytest.raises(InputError, match="is beyond"):
        read_trace(_trace(tmp_path / "huge.csv", "1e30,0.1,16,8,\n"))


# --- S3: explain on a record without steps ---------------------------------------------------------------

def test_explain_refuses_a_record_without_steps(capsys, table, tmp_path):
    rec = _record(capsys, table, tmp_path / "rec")
    (rec / "steps.csv").unlink()
    code, out, err = run_cli(traces.cli.main, capsys, "explain", rec)
    refused(code, err, str(rec), "no steps")
    assert "untimed" not in out


# --- S4: the engine's limits, each on its own ------------------------------------------------------------

@pytest.mark.parametrize("row, words", [("1,0.0,100,4,", "prompt of 100 tokens is beyond --max-prompt 96"),
                                        ("1,0.0,16,60,", "budget of 60 tokens is beyond --max-budget 32")],
                         ids=["prompt", "budget"])
def test_engine_run_refuses_a_request_past_max_prompt_or_max_budget(capsys, no_engine, tmp_path, row, words):
    trace = _trace(tmp_path / "t.csv", "0,0.0,16,4,\n" + row + "\n")  # 104 and 76 tokens: within 96 + 32
    code, _, err = run_cli(engine.cli.main, capsys, "run", "--device", "cpu", "--model", "tiny", "--trace", trace,
                           "--out", tmp_path / "rec")
    refused(code, err, "request 1: " + words)
    assert not (tmp_path / "rec").exists()


# --- S5: calibrate --refresh and another model's table ----------------------------------------------------

def test_refresh_refuses_a_table_of_another_model_before_the_engine_starts(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("servecap.engine.engine.Engine", lambda cfg: pytest.fail("the engine was started"))
    code, _, err = run_cli(calibrate.cli.main, capsys, "--refresh", REPO / "servecap/costs/data/h200.json", "--device", "cpu",
                           "--model", "tiny", "--quick", "--out", tmp_path / "refreshed.json")
    refused(code, err, "h200.json", "was measured on Qwen2.5-1.5B float16", "--model qwen2.5-1.5b")
    assert not (tmp_path / "refreshed.json").exists()


# --- S6: arrivals past what float64 time resolves ---------------------------------------------------------

def test_arrivals_past_the_float_resolution_limit_are_refused(capsys, table, tmp_path):
    far = _trace(tmp_path / "t.csv", "0,1e15,16,8,\n")
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--trace", far, "--table", table)
    refused(code, err, "line 3", "arrives at 1e+15 s, beyond the limit of 4,194,304 s")
    refused(*run_cli(sim.cli.main, capsys, "run", "--rate", "1e-9", "--n", "5", "--table", table)[::2],
            "beyond the limit of 4,194,304 s")
    # Just below the limit a step still moves the clock: the TTFT is the prefill's time, not 0
    near = _trace(tmp_path / "near.csv", "0,4000000,16,8,\n")
    assert run_cli(sim.cli.main, capsys, "run", "--trace", near, "--table", table, "--out", tmp_path / "rec")[0] == 0
    r = read_run(tmp_path / "rec").requests.iloc[0]
    assert r["first_token"] - r["arrival"] > 0 and r["finished"] > r["first_token"]


# --- S7: the same sweep writes the same bytes ------------------------------------------------------------

def test_the_same_sweep_writes_the_same_files_and_its_host_time_apart(capsys, table, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert run_cli(sim.cli.main, capsys, *SWEEP, "--table", table, "--out", out)[0] == 0
    for name in ("sweep.csv", "sweep.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    run = json.loads((a / "sweep.run.json").read_text())
    assert run["created_at"] and "git_commit" in run and run["command"].endswith(f"--out {a}")
    assert len(run["points"]) == 8 and all(p["sim_wall_s"] > 0 for p in run["points"])
