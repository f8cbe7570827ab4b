"""Issue 26's reliability audit, tracebacks and unclear messages (T1-T11, U1-U4): each test is built from its
reproduction script (../shared/audits/reliability/NN_*.sh) and fails on the code before the fix.

A refusal is one line on stderr naming the problem, exit status 2, no traceback, and it comes before any work.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import interpreter_buckets, linear_table, run_cli, write_table

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
from servecap.calibrate.store import PointsFile
from servecap.traces.errors import InputError
from servecap.traces.trace_io import write_trace
from servecap.traces.workload import poisson_trace

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
HEADER = '# {"meta": {}, "schema": "request-trace", "version": 1}'  # a trace whose meta names no kind
COLUMNS = "request_id,arrival_s,prompt_tokens,budget,prompt"


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


def refused(code: int, err: str, *words: str) -> None:
    """Exit status 2 and exactly one line on stderr, holding every one of `words`."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def no_simulation(monkeypatch):
    """A refusal must come before any simulated work."""
    import servecap.sim.simulator
    from servecap import sim
    monkeypatch.setattr(sim.simulator, "simulate", lambda *a, **k: pytest.fail("the simulation ran"))


@pytest.fixture
def read_only(monkeypatch):
    """A read-only filesystem everywhere, as access(2) answers on one (even to root)."""
    monkeypatch.setattr("servecap.traces.outpath.os.access", lambda path, mode: False)


def _record(table: Path, out: Path, *extra: str) -> Path:
    assert sim.cli.main([str(a) for a in ("run", "--table", table, "--out", out, *extra)]) == 0
    return out


# --- T1 (11): explain on a trace header without "kind"; --png with another suffix ------------------------------

def test_explain_reads_a_record_whose_trace_names_no_kind(capsys, table, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(f"{HEADER}\n{COLUMNS}\n0,0.1,16,8,\n1,0.2,16,8,\n")
    _record(table, tmp_path / "rec", "--trace", trace)
    capsys.readouterr()
    code, out, err = run_cli(traces.cli.main, capsys, "explain", tmp_path / "rec")
    assert code == 0 and "Traceback" not in err, err
    assert "wall time" in out


def test_explain_png_that_is_not_a_png_name_is_refused_before_explaining(capsys, table, tmp_path):
    rec = _record(table, tmp_path / "rec", "--rate", "5", "--n", "20")
    capsys.readouterr()
    code, out, err = run_cli(traces.cli.main, capsys, "explain", rec, "--png", tmp_path / "x.csv")
    refused(code, err, str(tmp_path / "x.csv"), ".png")
    assert out == "" and not (tmp_path / "x.csv").exists()


# --- T2, T3 (12): outputs checked before any work -------------------------------------------------------------

def test_sim_run_trace_events_that_cannot_be_written_is_refused_before_simulating(capsys, table, tmp_path,
                                                                                   no_simulation):
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--table", table, "--rate", "5", "--n", "20",
                           "--trace-events", f / "te.json")
    refused(code, err, str(f / "te.json"), "is a file, not a directory")


def test_sim_run_trace_events_on_a_read_only_filesystem_is_refused_before_simulating(capsys, table, tmp_path,
                                                                                      no_simulation, read_only):
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--table", table, "--rate", "5", "--n", "20",
                           "--trace-events", tmp_path / "te.json")
    refused(code, err, str(tmp_path / "te.json"), "read-only filesystem")


proc_only = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


@proc_only
def test_outputs_under_proc_are_refused_before_any_work(capsys, table, no_simulation):
    # access(2) says /proc is writable to root, but nothing can be made there
    for main, argv in ((sim.cli.main, ["run", "--table", table, "--rate", "5", "--n", "20", "--out", "/proc/rec"]),
                       (sim.cli.main, ["sweep", "--table", table, "--rates", "5", "--n", "20", "--pool-gib", "1",
                                       "--max-batch", "16", "--backend", "paged", "--out", "/proc/sw"]),
                       (calibrate.cli.main, ["--device", "cpu", "--model", "tiny", "--quick", "--out", "/proc/t.json"]),
                       (traces.cli.main, ["poisson", "--rate", "5", "--n", "3", "--out", "/proc/x.csv"])):
        code, _, err = run_cli(main, capsys, *argv)
        refused(code, err, "/proc", "cannot be written")
    assert not Path("/proc/rec").exists()


@pytest.mark.parametrize("step", ["plan", "sag", "predict"])
def test_validate_out_on_a_read_only_filesystem_is_refused_before_any_work(capsys, monkeypatch, tmp_path, read_only,
                                                                           step):
    import servecap.validate.plan
    from servecap import validate
    import servecap.validate.predict
    from servecap import validate
    import servecap.validate.sag
    from servecap import validate
    for module, name in ((validate.plan, "make_plan"), (validate.sag, "search"), (validate.predict,
                                                                                   "make_predictions")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the work started"))
    argv = [step, "--out", tmp_path / "val"] + (["--skip", "public,policies"] if step == "plan" else [])
    code, _, err = run_cli(validate.cli.main, capsys, *argv)
    refused(code, err, str(tmp_path / "val"), "read-only filesystem")


# --- T5 (13): a plan.json that is not a plan ----------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ('{"table": ', "is not valid JSON"),
    ("[]", "is not a validation plan"),
    ("{}", "is not a validation plan"),
    ('{"table": {"id": "t"}, "points": [{"id": "a", "colour": 1}], "predictions": {}}', "point 1 is not"),
    ('{"table": {"id": "t"}, "points": [{"id": "a", "role": "near", "trace": {}}], "predictions": {}}',
     "no prediction for point(s) a"),
])
def test_a_malformed_plan_is_one_line_from_report_and_real(capsys, tmp_path, text, words):
    (tmp_path / "plan.json").write_text(text + "\n")
    for step in ("report", "real"):
        code, _, err = run_cli(validate.cli.main, capsys, step, "--out", tmp_path)
        refused(code, err, str(tmp_path / "plan.json"), words)


# --- T6 (14): a record value that is not a number -------------------------------------------------------------

def test_a_non_number_in_steps_csv_is_named_by_line_and_column(capsys, table, tmp_path):
    rec = _record(table, tmp_path / "rec", "--rate", "10", "--n", "50")
    lines = (rec / "steps.csv").read_text().splitlines(keepends=True)
    i = next(i for i in range(4, len(lines)) if lines[i].split(",")[1] == "decode")  # as the script's sed does
    cells = lines[i].split(",")
    lines[i] = ",".join(cells[:2] + ["abc" + cells[2]] + cells[3:])
    (rec / "steps.csv").write_text("".join(lines))
    capsys.readouterr()
    for argv in (["explain", rec], ["timeline", rec, "--out", tmp_path / "tl.json"]):
        code, _, err = run_cli(traces.cli.main, capsys, *argv)
        refused(code, err, str(rec / "steps.csv"), f"line {i + 1}", "column 'rows'", f"'abc{cells[2]}' is not a number")


# --- T7 (15): a points file that is not UTF-8 ------------------------------------------------------------------

def test_a_points_file_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    path = tmp_path / "t.json.points.jsonl"
    path.write_bytes(b'{"schema": "calibration-points"}\n\xff\xfe garbage\n')
    with pytest.raises(InputError, match="line 2: is not UTF-8"):
        PointsFile(path, {"device": "cpu"})


def test_calibrate_on_a_points_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "t.json.points.jsonl").write_bytes(b"\xff\xfe garbage\n")
    code, _, err = run_cli(calibrate.cli.main, capsys, "--device", "cpu", "--model", "tiny", "--quick",
                           "--out", tmp_path / "t.json")
    refused(code, err, "t.json.points.jsonl", "is not UTF-8")


# --- T8 (16): engine sizes that cannot be allocated; the 1.5B model on the CPU -------------------------------

@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(engine.cli, "build_engine", lambda args: pytest.fail("the engine was started"))


TINY = ["run", "--device", "cpu", "--closed-uniform", "p16", "--n", "2", "--budget", "4"]


@pytest.mark.parametrize("args, words", [
    (["--model", "tiny", "--pool-gib", "1e9"], ["a KV pool of", "GiB of memory", "--pool-gib"]),
    (["--model", "tiny", "--pool-blocks", "1125899906842624"], ["a KV pool of 1,125,899,906,842,624 blocks"]),
    (["--max-batch", "2"], ["--device cpu runs --model tiny only", "GiB for its weights"]),
])
def test_engine_sizes_that_cannot_fit_are_refused_before_the_model_loads(capsys, no_engine, args, words):
    code, _, err = run_cli(engine.cli.main, capsys, *TINY, *args)
    refused(code, err, *words)


@pytest.mark.parametrize("args, words", [
    ([], ["give a workload: --rate, --trace FILE"]),
    (["--closed-uniform", "p16", "--rate", "3"], ["a closed run", "takes no --rate"]),
    (["--closed-mixed", "4", "--burstiness", "2"], ["--burstiness and --ramp-up-s shape the seeded trace of --rate"]),
])
def test_engine_workload_choices_are_refused_in_one_line_before_the_model_loads(capsys, no_engine, args, words):
    code, _, err = run_cli(engine.cli.main, capsys, "run", "--device", "cpu", "--model", "tiny", *args)
    refused(code, err, *words)


def test_engine_workload_from_a_trace_file_is_scaled_to_rate_as_the_simulators_is(tmp_path):
    from servecap.sim.inputs import make_trace
    from servecap.traces.trace_io import write_trace
    from servecap.traces.workload import poisson_trace
    path = write_trace(poisson_trace(2.0, 40, 3), tmp_path / "t.csv")
    args = engine.cli.parser().parse_args(["run", "--trace", str(path), "--rate", "8"])
    assert engine.cli.workload_from_args(args).requests == make_trace(rate=8.0, trace_file=path).requests
    args = engine.cli.parser().parse_args(["run", "--trace", str(path)])
    assert engine.cli.workload_from_args(args).requests == make_trace(trace_file=path).requests


def _limit_memory(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def test_an_engine_allocation_that_fails_is_one_line(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "engine", *TINY, "--model", "tiny", "--max-batch", "1000000"],
                          cwd=REPO, capture_output=True, text=True, preexec_fn=_limit_memory(6 << 30), timeout=300)
    refused(proc.returncode, proc.stderr, "does not fit in the host's memory", "--max-batch 1000000")


# --- T9 (17): a simulation too large for the memory it has -----------------------------------------------------

def test_sim_run_too_large_for_this_memory_is_refused_before_making_the_trace(capsys, monkeypatch, table, tmp_path,
                                                                              no_simulation):
    monkeypatch.setattr("servecap.traces.memory.available_bytes", lambda: 100 << 20)
    monkeypatch.setattr("servecap.traces.trace_io.poisson_trace", lambda *a, **k: pytest.fail("the trace was made"))
    code, _, err = run_cli(sim.cli.main, capsys, "run", "--table", table, "--rate", "100", "--n", "3000000")
    refused(code, err, "simulating 3,000,000 requests needs about", "--n")
    code, _, err = run_cli(sim.cli.main, capsys, "sweep", "--table", table, "--n", "3000000", "--out",
                           tmp_path / "sw", "--jobs", "2")
    refused(code, err, "simulating 3,000,000 requests", "in each of 2 processes", "--jobs")


def test_sim_run_under_ulimit_is_refused_in_seconds_not_a_memory_error_in_minutes():
    proc = subprocess.run([sys.executable, "-m", "sim", "run", "--rate", "100", "--n", "3000000"], cwd=REPO,
                          capture_output=True, text=True, preexec_fn=_limit_memory(1_500_000 << 10), timeout=120)
    refused(proc.returncode, proc.stderr, "simulating 3,000,000 requests needs about", "GiB of memory")


# --- T10 (18): the benchmarks --------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [(["--large-n", "-5"], "argument --large-n: '-5'"),
                                         (["--jobs", "0"], "argument --jobs: '0'"),
                                         (["--million-n", "0"], "argument --million-n: '0'")])
def test_sim_bench_sizes_are_refused(capsys, args, words):
    import servecap.sim.bench
    from servecap import sim
    code, _, err = run_cli(sim.bench.main, capsys, *args, "--quick")
    refused(code, err, words)


def test_engine_bench_without_a_gpu_is_one_line(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    import servecap.engine.bench
    from servecap import engine
    code, _, err = run_cli(engine.bench.main, capsys, "--quick")
    refused(code, err, "engine.bench: error: no CUDA GPU is visible")


@proc_only
def test_engine_bench_out_is_checked_before_measuring(capsys, monkeypatch):
    pytest.importorskip("torch")
    import servecap.engine.bench
    from servecap import engine
    monkeypatch.setattr(engine.bench, "Engine", lambda *a, **k: pytest.fail("the engine was started"))
    code, _, err = run_cli(engine.bench.main, capsys, "--quick", "--out", "/proc/bench")
    refused(code, err, "/proc/bench: cannot be written")


# --- T11 (23): a reader that goes away (`| head`) --------------------------------------------------------------

def _closed_stdout_run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    """ARGV with its stdout a pipe whose reader has already gone."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, *argv], cwd=cwd, stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    finally:
        os.close(w)


ENTRY_POINTS = tuple(f"servecap.{m}" for m in ("sim.cli", "traces.cli", "engine.cli", "calibrate.cli", "validate.cli",
                                                "sim.bench", "engine.bench", "engine.kernels.bench"))


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_line_entry_point_is_guarded(module):
    """Each `main` (`python -m ...` and the console scripts) runs inside traces.command's guard: one-line refusals,
    output that survives a reader that left."""
    import importlib
    if module.startswith("servecap.engine"):
        pytest.importorskip("torch")
    main = importlib.import_module(module).main
    assert main.__code__.co_name == "guarded" and main.__wrapped__.__module__ == module


def test_every_script_with_a_main_is_guarded_too():
    """scripts/ are command lines as well: each `main` is wrapped by traces.command's guard and parses with its Parser
    (read from the source: several import torch, which CI may lack)."""
    import ast
    for path in sorted((REPO / "scripts").glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        mains = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        for f in mains:
            guards = [d for d in f.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "command"]
            assert guards, f"{path.name}: main is not wrapped by @command"
            assert "argparse.ArgumentParser(" not in ast.get_source_segment(source, f), path.name


def test_a_path_that_is_not_there_is_one_line_naming_it(capsys, tmp_path):
    from servecap.traces.command import command

    @command("prog")
    def main(path):
        return len(open(path).read())
    assert main(tmp_path / "missing.csv") == 2
    assert capsys.readouterr().err == f"prog: error: {tmp_path / 'missing.csv'}: No such file or directory\n"
    assert main(tmp_path) == 2 and "Is a directory" in capsys.readouterr().err

    @command("prog")
    def unnamed():
        raise FileNotFoundError("no file named")  # an OSError without a path is a bug: its traceback is kept
    with pytest.raises(FileNotFoundError):
        unnamed()


@pytest.mark.parametrize("argv", [["sim", "run", "--rate", "5", "--n", "20"],
                                  ["traces", "poisson", "--rate", "5", "--n", "3", "--out", "{tmp}/t.csv"],
                                  ["traces", "show", "{tmp}/t.csv"],
                                  ["engine", "run", "--device", "cpu", "--model", "tiny", "--closed-uniform", "p16",
                                   "--n", "2", "--budget", "4"]], ids=lambda a: " ".join(a[:2]))
def test_a_command_piped_into_head_ends_quietly(argv, tmp_path):
    if argv[0] == "engine":
        pytest.importorskip("torch")
    if argv[1] == "show":
        write_trace(poisson_trace(5.0, 3, 0), tmp_path / "t.csv")
    proc = _closed_stdout_run(["-m", *[a.format(tmp=tmp_path) for a in argv]])
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr


def test_a_sweep_piped_into_head_still_writes_its_files(table, tmp_path):
    proc = _closed_stdout_run(["-m", "sim", "sweep", "--table", str(table), "--rates", "5,10", "--n", "20",
                               "--pool-gib", "1", "--max-batch", "16", "--backend", "paged", "--out",
                               str(tmp_path / "sw"), "--jobs", "1"])
    assert proc.returncode == 0 and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert {"sweep.csv", "sweep.json"} <= {p.name for p in (tmp_path / "sw").iterdir()}


# --- U1 (22): a broken fit says how to measure again -----------------------------------------------------------

@pytest.mark.slow
def test_a_broken_fit_from_kept_runs_says_to_delete_them(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from servecap.traces.provenance import versions
    # The kept runs predate the quick plan's fused (mixed) runs, which the first call measures before it fits: in
    # the interpreter's 16-token prefill buckets (helpers.interpreter_buckets), a quarter of the 64-token work.
    interpreter_buckets(monkeypatch)
    lines = (DATA / "calibrate_fit_broken.points.jsonl").read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["identity"].update(versions(("torch", "triton", "transformers")))  # the kept runs, as made here
    points = tmp_path / "t.json.points.jsonl"
    points.write_text(json.dumps(head, sort_keys=True) + "\n" + "".join(lines[1:]))
    for force in ([], ["--force"]):
        code, _, err = run_cli(calibrate.cli.main, capsys, "--device", "cpu", "--model", "tiny", "--quick",
                               "--out", tmp_path / "t.json", *force)
        assert code == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert "the fit is broken" in last and str(points) in last and "delete that file" in last, last
    assert points.exists()  # the message says what to do; the kept runs are not thrown away behind the user's back


# --- U2 (21): which path failed and why, in words ----------------------------------------------------------------

def test_traces_out_that_cannot_be_written_names_the_given_path_in_words(capsys, tmp_path, monkeypatch):
    f = tmp_path / "exist.csv"
    f.write_text("x")
    code, _, err = run_cli(traces.cli.main, capsys, "poisson", "--rate", "5", "--n", "3", "--out", f / "x.csv")
    refused(code, err, f"{f / 'x.csv'}: cannot be written: {f} is a file, not a directory")
    assert "Errno" not in err
    monkeypatch.setattr("servecap.traces.outpath.tempfile.mkstemp",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    code, _, err = run_cli(traces.cli.main, capsys, "poisson", "--rate", "5", "--n", "3", "--out", tmp_path / "y.csv")
    refused(code, err, f"{tmp_path / 'y.csv'}: cannot be written", "read-only filesystem")
    assert "Errno" not in err and ".tmp" not in err


def test_a_write_that_fails_names_the_file_asked_for_not_its_temporary(tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(src))
    monkeypatch.setattr("os.replace", full)
    with pytest.raises(InputError) as e:
        write_trace(poisson_trace(1.0, 5, 0), tmp_path / "t.csv")
    assert str(e.value) == f"{tmp_path / 't.csv'}: cannot be written: the disk is full"
    assert os.listdir(tmp_path) == []


# --- U3 (23): argparse's refusals in one line ---------------------------------------------------------------------

def _bench(name: str):
    import importlib
    return importlib.import_module(name).main


@pytest.mark.parametrize("main, argv, words", [
    (lambda: sim.cli.main, ["run", "--rate", "0"], "python -m sim run: error: argument --rate: '0'"),
    (lambda: sim.cli.main, ["sweep", "--jobs", "0"], "python -m sim sweep: error: argument --jobs"),
    (lambda: traces.cli.main, ["poisson", "--out", "x.csv"], "the following arguments are required: --rate"),
    (lambda: traces.cli.main, [], "python -m traces: error: the following arguments are required: COMMAND"),
    (lambda: engine.cli.main, ["run", "--device", "foo", "--rate", "1"], "'foo' is not a device"),
    (lambda: calibrate.cli.main, ["--max-batch", "0"], "python -m calibrate: error: argument --max-batch"),
    (lambda: validate.cli.main, ["plan", "--skip", "bogus"], "python -m validate plan: error: argument --skip"),
    (lambda: _bench("servecap.sim.bench"), ["--jobs", "x"], "python -m sim.bench: error: argument --jobs"),
])
def test_a_refused_option_is_one_line_that_points_to_help(capsys, main, argv, words):
    code, out, err = run_cli(main(), capsys, *argv)
    refused(code, err, words, "(see --help)")
    assert out == ""


def test_a_dependency_missing_from_the_environment_is_one_line_not_a_traceback():
    import subprocess
    import sys
    # simpy made unimportable, as on a GPU image without it: `validate plan` imports the fleet simulator.
    code = ("import sys; sys.modules['simpy'] = None; from servecap.validate.cli import main; "
            "sys.exit(main(['plan', '--out', 'unused', '--skip', 'curve']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == ["validate: error: simpy is not installed here; install the project "
                                     "(pip install -e .) or the package"]
    # One of the project's own modules missing is a bug, not the environment: its traceback is kept.
    own = code.replace("sys.modules['simpy']", "sys.modules['servecap.sim.fleet']")
    p = subprocess.run([sys.executable, "-c", own], capture_output=True, text=True)
    assert p.returncode == 1 and "Traceback" in p.stderr and "not installed" not in p.stderr


@pytest.mark.parametrize("package", ["sim", "validate", "traces", "calibrate", "engine"])
def test_a_dependency_a_command_line_imports_at_its_top_is_one_line_too(package):
    import subprocess
    import sys
    # numpy made unimportable: most command lines' modules import it, themselves or through a module, before their
    # guarded main runs, so `python -m PACKAGE` itself has to refuse in one line (servecap.traces.command.entry).
    code = (f"import runpy, sys; sys.modules['numpy'] = None; sys.argv = ['{package}', '--help']; "
            f"runpy.run_module('servecap.{package}', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [f"{package}: error: numpy is not installed here; install the project "
                                     "(pip install -e .) or the package"]


def test_every_command_line_parser_is_the_shared_one():
    from servecap.traces.command import Parser
    for make in (sim.cli.parser, traces.cli.parser, engine.cli.parser, calibrate.cli.parser, validate.cli.parser):
        top = make()
        assert isinstance(top, Parser)
        subs = [a for a in top._actions if a.__class__.__name__ == "_SubParsersAction"]
        assert all(isinstance(p, Parser) for s in subs for p in s.choices.values())


# --- U4 (23): options that would do nothing -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["run", "--rate", "5", "--n", "20", "--tokens"], "--tokens does nothing without --out"),
    (["run", "--rate", "5", "--n", "20", "--router", "least-tokens"], "--router does nothing with one replica"),
    (["sweep", "--rates", "5", "--router", "least-tokens"], "--router does nothing with one replica"),
])
def test_options_that_would_do_nothing_are_refused(capsys, table, no_simulation, argv, words):
    code, _, err = run_cli(sim.cli.main, capsys, *argv, "--table", table)
    refused(code, err, words)


def test_router_with_replicas_and_tokens_with_out_still_run(capsys, table, tmp_path):
    code, out, err = run_cli(sim.cli.main, capsys, "run", "--table", table, "--rate", "5", "--n", "20",
                             "--replicas", "2", "--router", "least-tokens", "--out", tmp_path / "rec", "--tokens")
    assert code == 0, err
    assert "least-tokens router" in out and (tmp_path / "rec" / "tokens.csv").exists()

