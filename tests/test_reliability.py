"""Bad input and interruptions: every refusal is one line naming the problem (exit status 2) before any work,
nothing recorded is lost or overwritten without --force, and interrupted work resumes.

The engine's CLI checks run without torch (they must refuse before the model loads); the one engine run here
(an interrupted tiny-model run on the CPU) skips without torch.
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import linear_table, run_cli, write_table

import servecap.calibrate.cli

from servecap import calibrate
import servecap.engine.cli
from servecap import engine
import servecap.sim.cli
import servecap.sim.sweep_cli
from servecap import sim
from servecap.costs.model import CostModel, ExtrapolationWarning
from servecap.costs.synthetic import synthetic_table
from servecap.costs.table import table_id
from servecap.sim.bands import Band, exceeds_seed_spread
from servecap.sim.report import mechanism, mean_result
from servecap.sim.store import FILE
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.sim.sweep import ConfigResult
from servecap.traces.errors import InputError
from servecap.traces.outpath import check_out_dir, check_out_file
from servecap.traces.records import read_run
from servecap.traces.trace_io import write_trace
from servecap.traces.workload import Request, Trace, length_trace, poisson_trace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


def refused(code: int, err: str, *words: str) -> None:
    """Exit status 2, the reason on the last line of stderr, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    for w in words:
        assert w in last, last


# --- output paths ----------------------------------------------------------------------------------------

def test_out_checks_refuse_a_file_a_file_parent_and_an_unwritable_directory(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(InputError, match="is a file; the output must be a directory"):
        check_out_dir(f)
    with pytest.raises(InputError, match=f"{f} is a file, not a directory"):
        check_out_dir(f / "sub" / "dir")
    with pytest.raises(InputError, match="is a directory; the output must be a file"):
        check_out_file(tmp_path)
    with pytest.raises(InputError, match=f"{f} is a file, not a directory"):
        check_out_file(f / "t.json")
    assert check_out_dir(tmp_path / "new" / "deeper") and check_out_file(tmp_path / "new" / "t.json")
    # Permissions do not stop root, so an unwritable directory is what access(2) says of a read-only filesystem.
    monkeypatch.setattr("servecap.traces.outpath.os.access", lambda path, mode: False)
    with pytest.raises(InputError, match="is not writable"):
        check_out_dir(tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_sim_run_out_that_cannot_be_a_directory_is_refused_before_simulating(capsys, table, tmp_path, where):
    f = tmp_path / "f"
    f.write_text("x")
    out = f if where == "file" else f / "run"
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--rate", "2", "--n", "20", "--table", table, "--out", out)
    refused(code, err, str(out))
    assert f.read_text() == "x"


@pytest.mark.parametrize("where", ["directory", "under-a-file"])
def test_calibrate_out_that_cannot_be_written_is_refused_before_the_engine(capsys, tmp_path, where):
    f = tmp_path / "f"
    f.write_text("x")
    out = tmp_path if where == "directory" else f / "t.json"
    code, _, err = run_cli(calibrate.cli.main, capsys, "--out", out, "--device", "cpu")
    refused(code, err, str(out))
    code, _, err = run_cli(calibrate.cli.main, capsys, "--refit", f, "--out", out)
    refused(code, err, str(out))


# --- sweeps: points kept as they finish, resume, --out ---------------------------------------------------

SWEEP = ["sweep", "--rates", "1,2,4,6", "--max-batch", "8", "--pool-gib", "0.5,2", "--backend", "paged",
         "--n", "40", "--jobs", "2"]


def _sweep(capsys, table, out, *extra) -> tuple[int, str, str]:
    return run_cli(sim.cli.main, capsys, *SWEEP, "--table", table, "--out", out, *extra)


def _same_results(a: Path, b: Path) -> None:
    """Two sweeps' files are the same bytes; only sweep.run.json says when, where and how fast each ran."""
    for name in ("sweep.csv", "sweep.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_sweep_keeps_each_point_as_it_finishes_and_resume_completes_it_identically(capsys, table, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _sweep(capsys, table, whole)[0] == 0
    points = (whole / FILE).read_text().splitlines(keepends=True)
    assert len(points) == 1 + 8 and json.loads(points[0])["schema"] == "sim-sweep-points"
    # An interrupted sweep: three points kept, a fourth cut off mid-line by the kill, no final files.
    cut.mkdir()
    (cut / FILE).write_text("".join(points[:4]) + points[4][:25])
    code, _, err = _sweep(capsys, table, cut)
    refused(code, err, "already holds a sweep", "--resume")
    code, out, _ = _sweep(capsys, table, cut, "--resume")
    assert code == 0 and "resuming: 3 results already in" in out
    _same_results(whole, cut)


def test_a_resume_of_another_sweep_is_refused(capsys, table, tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    assert _sweep(capsys, table, tmp_path / "whole")[0] == 0
    (out / FILE).write_text((tmp_path / "whole" / FILE).read_text().splitlines(keepends=True)[0])
    code, _, err = run_cli(sim.cli.main, capsys, *SWEEP[:-4], "--n", "41", "--jobs", "2", "--table", table,
                           "--out", out, "--resume")
    refused(code, err, "was written by another sweep", "workload")
    code, _, err = _sweep(capsys, table, tmp_path / "none", "--resume")
    refused(code, err, "no interrupted sweep to resume")


def test_a_finished_sweep_is_not_overwritten_without_force(capsys, table, tmp_path):
    out = tmp_path / "s"
    assert _sweep(capsys, table, out)[0] == 0
    before = (out / "sweep.csv").read_bytes()
    code, _, err = _sweep(capsys, table, out)
    refused(code, err, "already holds a sweep", "--force")
    assert (out / "sweep.csv").read_bytes() == before
    code, _, err = run_cli(sim.cli.main, capsys, *SWEEP[:2], "3", *SWEEP[3:], "--table", table, "--out", out, "--force")
    assert code == 0, err
    assert set(pd.read_csv(out / "sweep.csv")["rate"]) == {3.0}


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_a_sweep_out_that_cannot_be_a_directory_is_refused_before_computing(capsys, table, tmp_path, where,
                                                                             monkeypatch):
    f = tmp_path / "f"
    f.write_text("x")
    monkeypatch.setattr(sim.sweep_cli, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    code, _, err = _sweep(capsys, table, f if where == "file" else f / "sweep")
    refused(code, err, str(f))


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == str(pid):
                kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ctrl_c_reaches_it() -> None:
    """The child takes SIGINT as Ctrl-C even when the suite does not: a suite started as a background job of a shell
    without job control (`pytest ... &` in a script or a subshell) ignores SIGINT, and a child inheriting that would
    never hear the signal these tests send and would run on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_sweep(table: Path, out: Path, rates: int) -> tuple[subprocess.Popen, list[str]]:
    argv = ["sweep", "--rates", ",".join(str(r) for r in range(1, rates + 1)), "--max-batch", "8", "--pool-gib",
            "0.5", "--backend", "paged", "--n", "300", "--jobs", "2", "--table", str(table), "--out", str(out)]
    # A session of its own, so that a signal to its process group reaches the workers too, as Ctrl-C does.
    proc = subprocess.Popen([sys.executable, "-m", "sim", *argv], cwd=REPO, start_new_session=True, text=True,
                            preexec_fn=_ctrl_c_reaches_it, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, argv


def _wait_for_points(proc: subprocess.Popen, out: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / FILE).exists() and (out / FILE).read_text().count("\n") >= 1 + n:
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the sweep kept no {n} points: {proc.communicate()[1][-2000:]}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_keeps_the_finished_points_and_resume_gives_the_uninterrupted_results(capsys, table, tmp_path):
    out = tmp_path / "cut"
    proc, argv = _start_sweep(table, out, 24)
    _wait_for_points(proc, out, 3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1 and f"kept in {out / FILE}" in said[0] and said[0].endswith("--resume"), err
    assert "Traceback" not in err
    kept = (out / FILE).read_text().count("\n") - 1
    assert 3 <= kept < 24 and not (out / "sweep.csv").exists()
    assert run_cli(sim.cli.main, capsys, *argv, "--resume")[0] == 0
    assert run_cli(sim.cli.main, capsys, *argv[:-1], tmp_path / "whole")[0] == 0
    _same_results(tmp_path / "whole", out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_the_workers_end_with_a_sweep_killed_by_sigkill(table, tmp_path):
    out = tmp_path / "killed"
    proc, _ = _start_sweep(table, out, 24)
    _wait_for_points(proc, out, 2)
    workers = _children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, "workers outlived the sweep"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_during_sim_run_interval_says_interrupted_in_one_line(table, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "sim", "run", "--rate", "5", "--n", "3000", "--max-batch", "8",
                             "--pool-gib", "0.5", "--backend", "paged", "--interval", "90", "--jobs", "2",
                             "--table", str(table)], cwd=REPO, start_new_session=True, text=True,
                            preexec_fn=_ctrl_c_reaches_it, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert len(_children(proc.pid)) == 2, "the band's two workers never started"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "interval:" not in line]
    assert proc.returncode == 130 and lines == ["sim: interrupted"], err


# --- seed bands -------------------------------------------------------------------------------------------

def test_seeds_run_every_point_per_seed_and_report_bands(capsys, table, tmp_path):
    out = tmp_path / "seeds"
    code, stdout, err = run_cli(sim.cli.main, capsys, "sweep", "--seeds", "0-3", "--rates", "1,3,6", "--max-batch",
                                "8", "--pool-gib", "0.5", "--backend", "paged", "--n", "60", "--jobs", "2",
                                "--table", table, "--out", out)
    assert code == 0, err
    rows = pd.read_csv(out / "sweep.csv")
    assert sorted(rows["seed"].unique()) == [0, 1, 2, 3] and len(rows) == 12
    assert rows.groupby("seed")["trace_id"].nunique().eq(3).all() and rows["trace_id"].nunique() == 12
    bands = pd.read_csv(out / "sweep.bands.csv")
    assert list(bands["rate"]) == [1.0, 3.0, 6.0] and (bands["seeds"] == 4).all()
    for _, b in bands.iterrows():
        served = rows[rows["rate"] == b["rate"]]["served_rate"]
        assert b["served_rate_mean"] == pytest.approx(served.mean())
        assert b["served_rate_sd"] == pytest.approx(served.std(ddof=1))
        assert (b["served_rate_min"], b["served_rate_max"]) == (served.min(), served.max())
    assert "capacity bracket across 4 seeds" in stdout and "seed 3:" in stdout
    assert "served mean +/- sd [min, max]" in stdout and "across 4 seeds" in stdout
    doc = json.loads((out / "sweep.json").read_text())
    config = doc["configurations"][0]
    assert config["seeds"] == [0, 1, 2, 3] and len(config["capacity_per_seed"]) == 4
    assert doc["workload"]["seeds"] == [0, 1, 2, 3]
    # A list of seeds gives the same points for the seeds it shares with the range.
    code, _, _ = run_cli(sim.cli.main, capsys, "sweep", "--seeds", "3,1", "--rates", "1,3,6", "--max-batch", "8",
                         "--pool-gib", "0.5", "--backend", "paged", "--n", "60", "--jobs", "1", "--table", table,
                         "--out", tmp_path / "list")
    again = pd.read_csv(tmp_path / "list" / "sweep.csv")
    assert code == 0 and list(again["seed"].unique()) == [3, 1]
    cols = ["seed", "rate", "served_rate", "queue_wait_p50"]
    pd.testing.assert_frame_equal(again[cols].sort_values(["seed", "rate"]).reset_index(drop=True),
                                  rows[rows["seed"].isin([1, 3])][cols].sort_values(["seed", "rate"])
                                  .reset_index(drop=True))


@pytest.mark.parametrize("args, message", [
    (["--seeds", "5-2"], "is not a range of seeds"),
    (["--seeds", "0-x"], "is not a whole number >= 0"),
    (["--seeds", "0-5000"], "more than 1000 seeds"),
    (["--seeds", "0-3", "--seed", "2"], "not allowed with argument"),
])
def test_bad_seeds_are_refused(capsys, table, tmp_path, args, message):
    code, _, err = run_cli(sim.cli.main, capsys, "sweep", *args, "--table", table, "--out", tmp_path / "o")
    refused(code, err, message)


def test_a_band_and_whether_a_difference_exceeds_the_seed_spread():
    b = Band.of([1.0, 2.0, 3.0, float("nan")])
    assert (b.mean, b.sd, b.min, b.max, b.n) == (2.0, 1.0, 1.0, 3.0, 3)
    assert math.isnan(Band.of([4.0]).sd) and Band.of([]).n == 0
    # 3% +/- 3% across seeds is not a difference; paired seeds cancel the shared draw.
    rng = np.random.default_rng(0)
    base = 40 + rng.normal(0, 1.5, 12)
    sag = base * (1 - rng.normal(0.03, 0.03, 12))
    assert not exceeds_seed_spread(base, base * 0.99 + rng.normal(0, 1.5, 12))
    assert exceeds_seed_spread(base, sag, paired=True) == bool(abs(np.mean(base - sag)) > 2 * np.std(base - sag, ddof=1)
                                                                / math.sqrt(12))
    assert exceeds_seed_spread([40.0, 40.5, 39.5], 45.0) and not exceeds_seed_spread([40.0, 44.0, 36.0], 42.0)
    assert not exceeds_seed_spread([1.0], [2.0])  # one value a side: no spread to judge by
    with pytest.raises(ValueError):
        exceeds_seed_spread([1.0, 2.0], [1.0], paired=True)


def _point(rate, served, stable):
    return {"rate": rate, "served_rate": served, "stable": stable, "queue_wait_p50": 0.0 if stable else 10.0,
            "group_size_p95": 2, "group_size_max": 4, "padding_waste_p95": 0.1, "head_blocked_frac": 0.0,
            "rows_while_queued": 8.0}


def test_a_drop_within_the_seed_spread_is_not_called_a_sag():
    # Seed by seed the served rate at the last rate is 10% below the peak on one seed and 10% above on another:
    # the mean falls 5% but the seeds disagree about its sign.
    seeds = [ConfigResult(ServingConfig(max_batch=8, pool=PoolSize(gib=1.0)), 100, [1, 2, 3], None,
                          [_point(1, 1.0, True), _point(2, peak, False), _point(3, last, False)], seed=s)
             for s, (peak, last) in enumerate([(2.0, 1.6), (1.8, 1.95), (2.0, 1.7)])]
    lines = mechanism(mean_result(seeds), seeds)
    assert "no sag" in lines[0] and "within the seed spread" in lines[0]
    assert "sags" in mechanism(mean_result(seeds))[0]  # the mean alone would have called it one


# --- engine CLI: refused before the model loads ------------------------------------------------------------

@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(engine.cli, "build_engine", lambda args: pytest.fail("the engine was started"))


TINY = ["run", "--model", "tiny", "--device", "cpu", "--closed-mixed", "2"]


@pytest.mark.parametrize("args, message", [
    (["--pool-gib", "-1"], "'-1' is not a positive number of GiB"),
    (["--pool-gib", "nan"], "'nan' is not a positive number of GiB"),
    (["--pool-gib", "0"], "'0' is not a positive number of GiB"),
    (["--pool-blocks", "0"], "'0' is not a whole number of blocks"),
    (["--block-size", "0"], "'0' is not a power of two"),
    (["--block-size", "48"], "'48' is not a power of two"),
    (["--device", "foo"], "'foo' is not a device"),
    (["--dtype", "foo"], "invalid choice: 'foo'"),
    (["--repeat", "0"], "'0' is not a whole number >= 1"),
    (["--repeat", "-2"], "'-2' is not a whole number >= 1"),
    (["--warmup", "-1"], "'-1' is not a whole number >= 0"),
    (["--max-prompt", "0"], "'0' is not a whole number >= 1"),
    (["--max-budget", "-3"], "'-3' is not a whole number >= 1"),
    (["--max-batch", "0"], "'0' is not a whole number of batch rows"),
    (["--max-prompt", "2048"], "--max-prompt 2048 + --max-budget 32 is beyond --model tiny's 512 positions"),
    (["--backends", "paged,foo"], "--backends 'paged,foo': choose from paged, dense"),
    (["--prefill", "sideways"], "sideways"),
])
def test_engine_options_are_refused_before_the_model_loads(capsys, no_engine, args, message):
    code, _, err = run_cli(engine.cli.main, capsys, *TINY, *args)
    refused(code, err, message)


def test_the_default_workload_on_the_tiny_model_is_refused_at_start(capsys, no_engine):
    code, _, err = run_cli(engine.cli.main, capsys, "run", "--model", "tiny", "--rate", "5")
    refused(code, err, "the workload does not fit the engine (--model tiny, --max-prompt 96, --max-budget 32)",
            "request 0: prompt")


def test_the_engine_says_what_a_traces_import_dropped_before_it_runs(capsys, monkeypatch, tmp_path):
    from servecap.traces.cli import main as traces_main
    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": n, "output_length": 40, "hash_ids": [i]})
                           + "\n" for i, n in enumerate((20, 500, 30))))
    assert traces_main(["import-mooncake", str(src), "--out", str(tmp_path / "t.csv"), "--max-prompt", "96",
                        "--max-budget", "8"]) == 0

    def stop(args):
        raise InputError("stopped before the engine")
    monkeypatch.setattr(engine.cli, "build_engine", stop)
    capsys.readouterr()
    code, out, err = run_cli(engine.cli.main, capsys, "run", "--model", "tiny", "--device", "cpu", "--trace",
                             tmp_path / "t.csv")
    assert code == 2 and "stopped before the engine" in err
    assert "import   1 of 3 prompts over 96 tokens dropped, 2 of 2 outputs clipped to 8 tokens" in out
    # and a request whose prefill the step cap cannot hold is refused before the model loads
    code, _, err = run_cli(engine.cli.main, capsys, "run", "--model", "tiny", "--device", "cpu", "--closed-uniform",
                           "p16", "--n", "2", "--budget", "4", "--max-num-batched-tokens", "10")
    refused(code, err, "request 0: its prefill of 16 positions is beyond the per-step cap (max_num_batched_tokens 10)")


@pytest.mark.parametrize("where", ["file", "under-a-file", "a record"])
def test_engine_out_is_checked_before_the_model_loads(capsys, no_engine, tmp_path, where):
    f = tmp_path / "f"
    f.write_text("x")
    out = {"file": f, "under-a-file": f / "run", "a record": tmp_path / "rec"}[where]
    if where == "a record":
        out.mkdir()
        (out / "requests.csv").write_text("")
    code, _, err = run_cli(engine.cli.main, capsys, *TINY, "--out", out)
    refused(code, err, str(out))


def test_a_trace_file_with_a_repeated_id_is_refused_by_the_engine_and_the_simulator(capsys, no_engine, table,
                                                                                    tmp_path):
    path = write_trace(Trace([Request(0, 0.0, 20, 4), Request(1, 0.1, 20, 4), Request(0, 0.2, 20, 4)]),
                       tmp_path / "dup.csv")
    for main, argv in ((engine.cli.main, ["run", "--model", "tiny", "--device", "cpu", "--trace", path]),
                       (sim.cli.main, ["run", "--trace", path, "--table", table])):
        code, _, err = run_cli(main, capsys, *argv)
        refused(code, err, f"{path}, line 5, column 'request_id': request id 0 is repeated (first on line 3)")


# --- sim run: absurd sizes, options that do nothing, unknown commands ---------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--pool-gib", "1e300"], "'1e300' is not a positive number of GiB up to"),
    (["--pool-gib", "inf"], "'inf' is not a positive number of GiB"),
    (["--pool-blocks", str(2 ** 60)], "is not a whole number of blocks from 1 to"),
    (["--n", "1000000000000"], "'1000000000000' is not a whole number of requests from 1 to 10,000,000"),
    (["--max-batch", "1000000000"], "'1000000000' is not a whole number of batch rows from 1 to 1,000,000"),
])
def test_sizes_past_the_documented_limits_are_refused_naming_the_number(capsys, table, args, message):
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--rate", "2", *args, "--table", table)
    refused(code, err, message)


def test_a_huge_pool_costs_nothing_it_does_not_use(capsys, table):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, out, err = run_cli(sim.cli.main, capsys, "run", "--rate", "2", "--n", "40", "--pool-gib", "1e9",
                             "--table", table)
    assert code == 0, err
    assert "pool 585142857142 blocks (1e+09 GiB)" in out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


@pytest.mark.parametrize("args, message", [
    (["--trace", "@", "--n", "10"], "--n does nothing with --trace"),
    (["--trace", "@", "--seed", "3"], "--seed does nothing with --trace"),
    (["--closed-mixed", "10", "--n", "10"], "--n does nothing with --closed-mixed N"),
    (["--closed-uniform", "p16", "--seed", "1"], "--seed does nothing with --closed-uniform"),
])
def test_options_that_would_do_nothing_are_refused(capsys, table, tmp_path, args, message):
    trace = write_trace(poisson_trace(2.0, 10, 0), tmp_path / "t.csv")
    args = [str(trace) if a == "@" else a for a in args]
    code, _, err = run_cli(sim.cli.main, capsys, "run", *args, "--table", table)
    refused(code, err, message)


def test_sweep_refuses_seeds_with_a_trace_file(capsys, table, tmp_path):
    trace = write_trace(poisson_trace(2.0, 10, 0), tmp_path / "t.csv")
    code, _, err = run_cli(sim.cli.main, capsys, "sweep", "--trace", trace, "--seeds", "0-2", "--table", table,
                           "--out", tmp_path / "o")
    refused(code, err, "--seeds does nothing with --trace")


def test_an_unknown_command_is_named(capsys):
    code, _, err = run_cli(sim.cli.main, capsys, "foo", "--rate", "1")
    refused(code, err, "unknown command 'foo'")


# --- cost tables ----------------------------------------------------------------------------------------

def _broken(edit) -> dict:
    t = linear_table()
    edit(t)
    if "table_id" in t:
        t["table_id"] = table_id(t)  # the content's own id: the problem is the edit, not a mismatched id
    return t


def _per_token(t: dict) -> None:
    d = t["fit"]["decode"]["paged"]
    d["per_token_s"] = [1.0] * len(d["per_token_s"])
    d.pop("floor", None)  # a table fitted before the floor: nothing holds its shorter rows' saving up


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["fit"]["prefill"].update(base_s=float("nan")), "fit.prefill.base_s must be a non-negative finite"),
    (lambda t: t["fit"]["prefill"].update(per_token_s=-1e-5), "fit.prefill.per_token_s must be a non-negative"),
    (lambda t: t["fit"]["decode"]["paged"]["knots"][0].__setitem__(0, [16, float("nan")]), "knots[0] seconds"),
    (lambda t: t.pop("table_id"), "missing 'table_id'"),
    (lambda t: t.update(fit={}), "missing fit.'prefill'"),
    (_per_token, "fitted paged decode step is not a positive duration"),
])
def test_a_broken_cost_table_is_one_line_from_sim_run(capsys, tmp_path, edit, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_broken(edit)))
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--rate", "2", "--n", "10", "--table", path)
    refused(code, err, str(path), message)


def test_a_broken_cost_table_is_exit_2_and_one_line_from_the_command_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_broken(lambda t: t["fit"]["prefill"].update(base_s=float("nan")))))
    done = subprocess.run([sys.executable, "-m", "sim", "run", "--rate", "2", "--table", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "fit.prefill.base_s" in done.stderr


def test_decode_past_the_widest_measured_batch_never_gets_cheaper_as_rows_are_added():
    # A table whose 32-row steps came out cheaper than its 16-row ones (noise): the line through them falls.
    table = synthetic_table(lambda s: 0.01, lambda b, r, t, m: 0.030 if r == 32 else 0.020 + 0.001 * min(r, 16))
    cost = CostModel(table)
    at = {r: float(cost.decode("paged", r, r * 100, 100)) for r in (16, 32)}
    assert at[32] < at[16]
    with pytest.warns(ExtrapolationWarning, match="decode rows 40"):
        wider = [float(cost.decode("paged", r, r * 100, 100)) for r in (40, 64, 128)]
    assert wider == sorted(wider) and min(wider) >= at[32]


# --- an engine run interrupted ----------------------------------------------------------------------------

@pytest.mark.slow
def test_an_interrupted_engine_run_keeps_every_completed_row(tmp_path):
    pytest.importorskip("torch")
    trace = write_trace(length_trace([(0.2 * i, 12, 3) for i in range(200)]), tmp_path / "t.csv")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "engine", "run", "--device", "cpu", "--model", "tiny", "--trace",
                             str(trace), "--out", str(out), "--backends", "paged", "--max-prompt", "16",
                             "--max-budget", "4", "--max-batch", "2", "--block-size", "16"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ctrl_c_reaches_it, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 400
    requests = out / "requests.csv"
    while proc.poll() is None and time.monotonic() < deadline:
        if requests.exists() and requests.read_text().count("\n") >= 2 + 3:  # header, columns, three rows
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and f"completed rows are kept in {out}" in err
    rec = read_run(out)
    assert rec.meta["status"] == "running"
    assert 3 <= len(rec.requests) < 200
    assert (rec.requests["output_tokens"] == 3).all() and len(rec.tokens) == 3 * len(rec.requests)


def test_commit_named_by_the_gpu_script_wins_over_a_stale_git(monkeypatch):
    """A working tree sent to a GPU machine may carry an older .git: the commit the script names is the record's."""
    from servecap.traces.provenance import git_commit
    git_commit.cache_clear()
    monkeypatch.setenv("SERVECAP_GIT_COMMIT", "abc1234")
    try:
        assert git_commit() == "abc1234"
    finally:
        git_commit.cache_clear()
