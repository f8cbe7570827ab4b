"""Shared formats and workloads: seeded traces, prompts, file round trips, importers, the traces CLI.

Expectations are computed here independently of the code under test (plain csv and datetime parsing,
hand-written files, values pinned once).
"""
from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from traces.cli import main
from traces.errors import InputError
from traces.importers import ImportOptions, import_azure, import_table
from traces.prompts import PROMPT_LENGTHS, prompt_tokens
from traces import records
from traces.records import RunWriter, read_run
from traces.trace_io import read_trace, write_trace
from traces.workload import closed_mixed, closed_uniform, length_trace, mixed_draw, poisson_trace

REPO = Path(__file__).resolve().parents[1]
AZURE = Path("/work/shared/data/traces/AzureLLMInferenceTrace_conv.csv")
needs_azure = pytest.mark.skipif(not AZURE.exists(), reason=f"{AZURE} is not on this machine")


# --- seeded workloads --------------------------------------------------------------------------------

def test_same_rate_n_seed_gives_byte_identical_files(tmp_path):
    paths = [tmp_path / "a.csv", tmp_path / "b" / "a.csv"]
    for p in paths:
        assert main(["poisson", "--rate", "2.5", "--n", "50", "--seed", "7", "--out", str(p)]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert poisson_trace(2.5, 50, 7).trace_id != poisson_trace(2.5, 50, 8).trace_id


def test_same_n_seed_at_two_rates_holds_the_same_requests_scaled_in_time():
    slow, fast = poisson_trace(1.0, 300, 3), poisson_trace(4.0, 300, 3)
    assert [(r.prompt, r.budget) for r in slow.requests] == [(r.prompt, r.budget) for r in fast.requests]
    for s, f in zip(slow.requests, fast.requests):
        assert f.arrival == pytest.approx(s.arrival / 4, abs=1e-6)  # both rounded to microseconds
    gaps = [b.arrival - a.arrival for a, b in zip(slow.requests, slow.requests[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1.0, rel=0.2)


def test_prompts_have_their_lengths_and_fixed_token_ids():
    for name, length in PROMPT_LENGTHS.items():
        toks = prompt_tokens(length)
        assert len(toks) == length and all(0 <= t < 151643 for t in toks), name
    # Pinned once: the prompts must never change, or old runs stop being comparable with new ones.
    assert prompt_tokens(16)[:4] == [146592, 85390, 145814, 2905]
    assert prompt_tokens(256)[:2] == [126058, 116923]
    assert prompt_tokens(4096)[-2:] == [96931, 43940]


def test_mixed_draws_are_uniform_over_prompts_and_budgets():
    n = 5000
    draw = mixed_draw(n, 11)
    prompts, budgets = Counter(p for p, _ in draw), Counter(b for _, b in draw)
    assert set(prompts) == set(PROMPT_LENGTHS) and set(budgets) == {64, 128, 192, 256}
    # Bounds of about five standard deviations of a uniform draw of this size.
    assert all(abs(c - n / 5) < 150 for c in prompts.values()), prompts
    assert all(abs(c - n / 4) < 160 for c in budgets.values()), budgets
    assert sum(b for _, b in draw) / n == pytest.approx(160, abs=5)


# --- round trips -------------------------------------------------------------------------------------

@pytest.mark.parametrize("trace", [
    poisson_trace(3.0, 40, 1), closed_mixed(10, 2), closed_uniform("p1024", 4, 64),
    length_trace([(0.0, 10, 5), (0.25, 3000, 256), (1.123456, 7, 1)], {"kind": "import", "note": "x"}),
], ids=["poisson", "closed-mixed", "closed-uniform", "lengths"])
def test_trace_file_round_trips(tmp_path, trace):
    back = read_trace(write_trace(trace, tmp_path / "t.csv"))
    assert back.requests == trace.requests
    assert back.meta == trace.meta
    assert back.trace_id == trace.trace_id


REQUEST_ROWS = [(i, 0.1 * i, 0.1 * i + 0.02, i, i, 1, 0.1 * i + 0.05, 1.5 + i, 16, 64, 2, 0) for i in range(3)]
STEP_ROWS = [(0, "prefill", 1, 16, 16, 16, 256, 0, 0, 0, 0.0, 0.01, 0, 1, 0, 0),
             (1, "decode", 1, 0, 0, 0, 0, 17, 17, 17, 0.01, 0.02, -1, 0, 0, 0)]
TOKEN_ROWS = [(0, 0, 0.01, 17), (0, 1, 0.02, 4)]
# The line separator inside the reason once split a row in two when read back.
REJECTED_ROWS = [(9, 0.5, "request 9: needs 99 blocks\u2028the pool has 10")]


def _rows(frame) -> list[tuple]:
    return [tuple(r) for r in frame.itertuples(index=False)]


def test_run_record_round_trips(tmp_path):
    w = RunWriter(tmp_path / "run", {"kind": "sim", "rate": 2.0})
    for table, rows in (("requests", REQUEST_ROWS), ("steps", STEP_ROWS), ("tokens", TOKEN_ROWS),
                        ("rejected", REJECTED_ROWS)):
        w.add_many(table, rows)
    w.close(served=3)
    rec = read_run(tmp_path / "run")
    assert (rec.meta["status"], rec.meta["served"], rec.meta["rate"]) == ("complete", 3, 2.0)
    assert _rows(rec.requests) == REQUEST_ROWS
    assert _rows(rec.steps) == STEP_ROWS
    assert _rows(rec.tokens) == TOKEN_ROWS
    assert _rows(rec.rejected) == REJECTED_ROWS


def test_run_killed_midway_keeps_every_complete_row(tmp_path):
    w = RunWriter(tmp_path / "run", {"kind": "engine"})
    for row in REQUEST_ROWS:
        w.add("requests", row)
    with open(tmp_path / "run" / "requests.csv", "a") as f:
        f.write("3,0.3,0.31,3")  # the process died while writing this row
    rec = read_run(tmp_path / "run")
    assert rec.meta["status"] == "running"
    assert _rows(rec.requests) == REQUEST_ROWS


def test_version_1_run_records_still_read(tmp_path):
    """A record written before version 2: its prefill steps' tokens and work follow from rows x padded_len."""
    run = tmp_path / "v1"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"schema": "run-record", "version": 1, "status": "complete"}))
    head = '# {"schema": "run-record/%s", "version": 1}\n'
    (run / "requests.csv").write_text(head % "requests" + "request_id,arrival,admitted,admit_step,group_id,group_size,"
                                      "first_token,finished,prompt_tokens,output_tokens,blocks\n"
                                      "0,0.0,0.0,0,0,2,0.1,0.5,16,4,1\n")
    (run / "steps.csv").write_text(head % "steps" + "step,kind,rows,padded_len,prompt_tokens,kv_tokens,kv_max,kv_read,"
                                   "start,end,group_id,admitted,retired\n0,prefill,2,256,272,0,0,0,0.0,0.1,0,2,0\n"
                                   "0,decode,2,0,0,274,257,274,0.1,0.11,-1,0,0\n")
    rec = read_run(run)
    assert list(rec.steps["tokens"]) == [512, 0] and list(rec.steps["attn"]) == [2 * 256 * 256, 0]
    assert list(rec.requests["replica"]) == [0] and list(rec.steps.columns) == list(records.STEP_COLUMNS)


# --- importers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def azure_rows() -> list[tuple[float, int, int]]:
    """(seconds after the first row, prompt, output) per row, parsed here with csv and datetime alone."""
    with open(AZURE, newline="") as f:
        rows = list(csv.DictReader(f))
    first = datetime.strptime(rows[0]["TIMESTAMP"][:19], "%Y-%m-%d %H:%M:%S")

    def seconds(ts: str) -> float:  # whole seconds by datetime, the 7 fractional digits by hand
        return (datetime.strptime(ts[:19], "%Y-%m-%d %H:%M:%S") - first).total_seconds() + int(ts[20:]) / 1e7

    return [(seconds(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]


def _expect(rows, lo=0.0, hi=float("inf"), max_prompt=4096, max_budget=256):
    t0 = rows[0][0]
    inside = [r for r in rows if lo <= r[0] - t0 < hi]
    kept = [r for r in inside if r[1] <= max_prompt]
    return inside, kept, sum(r[2] > max_budget for r in kept)


@needs_azure
def test_azure_import_keeps_and_clips_what_an_independent_count_says(azure_rows):
    _, kept, clipped = _expect(azure_rows)
    trace, report = import_azure(AZURE)
    assert len(kept) == 18964  # SOURCES.md's "filtered" count, as a cross-check of the count itself
    assert (report.rows_read, report.outside_window, report.dropped_prompt) == (len(azure_rows), 0, len(azure_rows) - len(kept))
    assert (report.clipped_budget, report.kept, len(trace)) == (clipped, len(kept), len(kept))
    assert [(r.prompt_tokens, r.budget) for r in trace.requests] == [(p, min(o, 256)) for _, p, o in kept]
    assert trace.requests[0].arrival == 0.0
    assert trace.requests[-1].arrival == pytest.approx(kept[-1][0] - kept[0][0], abs=1e-6)
    assert report.offered_rate == pytest.approx((len(kept) - 1) / (kept[-1][0] - kept[0][0]))
    assert trace.meta["source"]["file"] == AZURE.name
    assert trace.meta["source"]["sha256"] == hashlib.sha256(AZURE.read_bytes()).hexdigest()
    assert trace.meta["report"]["kept"] == len(kept)
    assert trace.meta["options"] == {"max_prompt": 4096, "max_budget": 256, "window": None, "compress": 1.0}


@needs_azure
def test_azure_window_and_compression(azure_rows):
    inside, kept, clipped = _expect(azure_rows, 600, 1200)
    windowed, report = import_azure(AZURE, ImportOptions(window=(600, 1200)))
    assert (report.outside_window, report.dropped_prompt) == (len(azure_rows) - len(inside), len(inside) - len(kept))
    assert (report.kept, report.clipped_budget) == (len(kept), clipped)
    assert [r.prompt_tokens for r in windowed.requests] == [p for _, p, _ in kept]
    assert windowed.requests[0].arrival == 0.0
    assert windowed.requests[-1].arrival == pytest.approx(kept[-1][0] - kept[0][0], abs=1e-6)

    fast, fast_report = import_azure(AZURE, ImportOptions(window=(600, 1200), compress=4))
    assert [(r.prompt_tokens, r.budget) for r in fast.requests] == [(r.prompt_tokens, r.budget) for r in windowed.requests]
    for f, w in zip(fast.requests, windowed.requests):
        assert f.arrival == pytest.approx(w.arrival / 4, abs=1e-6)
    assert fast_report.offered_rate == pytest.approx(4 * report.offered_rate, rel=1e-6)


def test_csv_import_with_numeric_seconds_and_caps(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("t,plen,olen,extra\n10.5,100,300,x\n11.0,5000,10,y\n12.25,4096,256,z\n\n12.25,7,257.0,w\n")
    trace, report = import_table(p, "t", "plen", "olen")
    assert [(r.arrival, r.prompt_tokens, r.budget) for r in trace.requests] == [
        (0.0, 100, 256), (1.75, 4096, 256), (1.75, 7, 256)]
    assert (report.rows_read, report.dropped_prompt, report.clipped_budget, report.kept) == (4, 1, 2, 3)
    assert report.offered_rate == pytest.approx(2 / 1.75)


def test_jsonl_import_with_zoned_iso_datetimes(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"ts": "2024-03-31T00:59:59.9999990Z", "in": 5, "out": 6}\n\n'
                 '{"ts": "2024-03-31T03:00:01.25+02:00", "in": 7, "out": 8.0}\n')
    trace, _ = import_table(p, "ts", "in", "out")
    assert [(r.arrival, r.prompt_tokens, r.budget) for r in trace.requests] == [(0.0, 5, 6), (1.250001, 7, 8)]


# --- bad input ---------------------------------------------------------------------------------------

def _assert_names(err: pytest.ExceptionInfo, path: Path, line: int, column: str | None) -> None:
    msg = str(err.value)
    assert str(path) in msg and f"line {line}" in msg, msg
    assert column is None or repr(column) in msg, msg


TRACE_HEADER = '# {"schema": "request-trace", "version": 1}\n'
TRACE_COLUMNS = "request_id,arrival_s,prompt_tokens,budget,prompt\n"


def test_a_repeated_request_id_is_left_to_the_engine_to_refuse(tmp_path):
    # The engine and the simulator refuse the second request at submit and serve the rest (issue 3).
    p = tmp_path / "dup.csv"
    p.write_text(TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,64,p16\n0,0.6,16,64,p16\n")
    assert [r.request_id for r in read_trace(p).requests] == [0, 0]


@pytest.mark.parametrize("text, line, column", [
    (TRACE_HEADER + TRACE_COLUMNS + "0,1.0,16,64,p16\n1,0.5,16,64,p16\n", 4, "arrival_s"),  # unsorted
    (TRACE_HEADER + TRACE_COLUMNS + "0,-0.5,16,64,p16\n", 3, "arrival_s"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,12.5,64,\n", 3, "prompt_tokens"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,0,p16\n", 3, "budget"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,nan,16,64,p16\n", 3, "arrival_s"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,NaN,64,\n", 3, "prompt_tokens"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,20,64,p16\n", 3, "prompt"),  # name and length disagree
    (TRACE_HEADER + "request_id,arrival_s,prompt_tokens,prompt\n0,0.5,16,p16\n", 2, "budget"),  # missing column
    ('# {"schema": "request-trace", "version": 2}\n' + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),
    ('# {"schema": "run-record/requests", "version": 1}\n' + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),
], ids=["unsorted", "negative-arrival", "non-integer", "non-positive", "nan-arrival", "nan-length",
        "prompt-mismatch", "missing-column", "unknown-version", "wrong-schema"])
def test_bad_trace_files_are_refused_where_they_are_bad(tmp_path, text, line, column):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(InputError) as err:
        read_trace(p)
    _assert_names(err, p, line, column)


@pytest.mark.parametrize("name, text, line, column", [
    ("a.csv", "ts,in\n1.0,5\n", 1, "out"),
    ("a.csv", "ts,in,out\n1.0,5,6\n2.0,12.5,6\n", 3, "in"),
    ("a.csv", "ts,in,out\n1.0,5,0\n", 2, "out"),
    ("a.csv", "ts,in,out\n1.0,-5,6\n", 2, "in"),
    ("a.csv", "ts,in,out\n1.0,5,nan\n", 2, "out"),
    ("a.csv", "ts,in,out\n1.0,,6\n", 2, "in"),
    ("a.csv", "ts,in,out\nNaN,5,6\n", 2, "ts"),
    ("a.csv", "ts,in,out\n2023-11-16 18:15:46.1,5,6\nsoon,5,6\n", 3, "ts"),
    ("a.csv", "ts,in,out\n2023-11-16 18:15:47,5,6\n2023-11-16 18:15:46.9999999,5,6\n", 3, "ts"),  # out of order
    ("a.csv", "ts,in,out\n1.0,5,6\n2023-11-16 18:15:46,5,6\n", 3, "ts"),  # seconds, then a datetime
    ("a.csv", "ts,in,out\n1.0,5,6\n2.0,5\n", 3, None),  # a short row
    ("a.jsonl", '{"ts": 1, "in": 5, "out": 6}\n\n{"ts": 2, "out": 6}\n', 3, "in"),
    ("a.jsonl", '{"ts": 1, "in": 5, "out": null}\n', 1, "out"),
    ("a.jsonl", '{"ts": 1, "in": 5, "out": 6}\n{"ts": 2,\n', 2, None),
], ids=["missing-column", "non-integer", "zero", "negative", "nan-length", "empty", "nan-time", "unparseable-time",
        "out-of-order", "mixed-times", "short-row", "jsonl-missing", "jsonl-null", "jsonl-broken"])
def test_bad_import_files_are_refused_where_they_are_bad(tmp_path, name, text, line, column):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(InputError) as err:
        import_table(p, "ts", "in", "out")
    _assert_names(err, p, line, column)


@pytest.mark.parametrize("options", [dict(compress=0), dict(compress=-2.0), dict(compress=float("nan")),
                                     dict(window=(5, 5)), dict(window=(5, 1)), dict(window=(-1, 3)),
                                     dict(max_prompt=0), dict(max_budget=1.5)])
def test_bad_import_options_are_refused(options):
    with pytest.raises(InputError):
        ImportOptions(**options)


def test_a_window_past_the_data_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("ts,in,out\n0,5,6\n10,5,6\n")
    with pytest.raises(InputError, match="window") as err:
        import_table(p, "ts", "in", "out", ImportOptions(window=(20, 30)))
    assert str(p) in str(err.value)


# --- command line ------------------------------------------------------------------------------------

def test_help_runs_and_nothing_under_traces_imports_torch():
    run = subprocess.run([sys.executable, "-m", "traces", "--help"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0 and all(c in run.stdout for c in ("poisson", "closed", "import-azure", "show"))
    check = ("import pkgutil, importlib, sys, traces\n"
             "for m in pkgutil.iter_modules(traces.__path__):\n"
             "    if m.name != '__main__': importlib.import_module('traces.' + m.name)\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n")
    run = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("rate", ["0", "-1", "nan"])
def test_non_positive_rate_is_a_clear_error(tmp_path, capsys, rate):
    with pytest.raises(SystemExit) as exit_:
        main(["poisson", f"--rate={rate}", "--out", str(tmp_path / "t.csv")])
    assert exit_.value.code == 2
    assert "--rate" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def test_bad_file_prints_one_line_and_exits_2(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text(TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,x,p16\n")
    assert main(["show", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(p) in err and "line 3" in err and "'budget'" in err


def test_closed_and_show(tmp_path, capsys):
    out = tmp_path / "c.csv"
    assert main(["closed", "--prompt", "p256", "--n", "3", "--budget", "64", "--out", str(out)]) == 0
    assert [(r.arrival, r.prompt_tokens, r.budget, r.prompt) for r in read_trace(out).requests] == [(0.0, 256, 64, "p256")] * 3
    assert main(["closed", "--mixed", "--n", "3", "--budget", "64", "--out", str(out)]) == 2  # budget is the draw's
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert read_trace(out).trace_id in shown and "closed-uniform" in shown


def test_import_command_prints_the_report_and_records_it(tmp_path, capsys):
    src, out = tmp_path / "src.csv", tmp_path / "t.csv"
    src.write_text("when,p,o\n0,10,300\n1,9000,5\n2,20,30\n4,30,40\n")
    assert main(["import", str(src), "--timestamp", "when", "--input", "p", "--output", "o", "--window", "0:3",
                 "--compress", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rows kept                  2" in printed and "outside the window         1" in printed
    trace = read_trace(out)
    assert [(r.arrival, r.prompt_tokens, r.budget) for r in trace.requests] == [(0.0, 10, 256), (1.0, 20, 30)]
    assert trace.meta["report"] == {"rows_read": 4, "outside_window": 1, "dropped_prompt": 1, "clipped_budget": 1,
                                    "kept": 2, "span_s": 1.0, "offered_rate": 1.0}
    assert trace.meta["options"]["window"] == [0.0, 3.0]
    assert trace.meta["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert json.loads(out.read_text().splitlines()[0][2:])["trace_id"] == trace.trace_id
