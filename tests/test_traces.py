"""Shared formats and workloads: seeded traces, prompts, file round trips, importers, the traces CLI.

Expectations are computed here independently of the code under test (plain csv and datetime parsing,
hand-written files, values pinned once).
"""
from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from shared_data import TRACES

from servecap.traces.cli import main
from servecap.costs.table import load_cost_table
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.importers import ImportOptions, import_azure, import_lengths, import_note, import_table, time_unit_warning
from servecap.traces.prompts import PROMPT_LENGTHS, prompt_tokens
from servecap.traces import records
from servecap.traces.records import RunWriter, read_run
from servecap.traces.trace_io import read_trace, write_trace
from servecap.traces.workload import closed_mixed, closed_uniform, length_trace, mixed_draw, poisson_arrivals, poisson_trace

REPO = Path(__file__).resolve().parents[1]
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
needs_azure = pytest.mark.skipif(not AZURE.exists(), reason=f"{AZURE} is not on this machine")
SHAREGPT = TRACES / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
needs_sharegpt = pytest.mark.skipif(not SHAREGPT.exists(), reason=f"{SHAREGPT} is not on this machine")


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


REQUEST_ROWS = [(i, 0.1 * i, 0.1 * i + 0.02, i, i, 1, 0.1 * i + 0.05, 1.5 + i, 16, 64, 2, 0, i, 3 * i, 64 * i)
                for i in range(3)]
STEP_ROWS = [(0, "prefill", 1, 16, 16, 16, 256, 0, 0, 0, 0.0, 0.01, 0, 1, 0, 0, 0, 7, 0),
             (1, "decode", 1, 0, 0, 0, 0, 17, 17, 17, 0.01, 0.02, -1, 0, 0, 0, 1, 0, 0),
             (2, "mixed", 3, 8, 8, 10, 90, 40, 21, 40, 0.02, 0.03, 1, 0, 0, 0, 0, 0, 2)]
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


CAPS = ImportOptions(max_prompt=4096, max_budget=256)  # the caps every import applied before full lengths


@needs_azure
def test_azure_import_keeps_every_row_at_full_length_by_default(azure_rows):
    trace, report = import_azure(AZURE)
    assert (report.rows_read, report.dropped_prompt, report.clipped_budget, report.kept) == (len(azure_rows), 0, 0,
                                                                                              len(azure_rows))
    assert [(r.prompt_tokens, r.budget) for r in trace.requests] == [(p, o) for _, p, o in azure_rows]
    assert max(r.prompt_tokens for r in trace.requests) == 14050  # SOURCES.md's max
    assert trace.meta["options"]["max_prompt"] is None and trace.meta["options"]["max_budget"] is None
    assert import_note(trace.meta) == "full lengths (no prompt or output cap)"


@needs_azure
def test_azure_import_keeps_and_clips_what_an_independent_count_says(azure_rows):
    _, kept, clipped = _expect(azure_rows)
    trace, report = import_azure(AZURE, CAPS)
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
    assert trace.meta["options"] == {"max_prompt": 4096, "max_budget": 256, "window": None, "compress": 1.0,
                                     "time_unit": "s"}
    assert import_note(trace.meta) == (f"{len(azure_rows) - len(kept)} of {len(azure_rows)} prompts over 4096 tokens "
                                       f"dropped, {clipped} of {len(kept)} outputs clipped to 256 tokens")


@needs_azure
def test_azure_window_and_compression(azure_rows):
    inside, kept, clipped = _expect(azure_rows, 600, 1200)
    windowed, report = import_azure(AZURE, ImportOptions(4096, 256, window=(600, 1200)))
    assert (report.outside_window, report.dropped_prompt) == (len(azure_rows) - len(inside), len(inside) - len(kept))
    assert (report.kept, report.clipped_budget) == (len(kept), clipped)
    assert [r.prompt_tokens for r in windowed.requests] == [p for _, p, _ in kept]
    assert windowed.requests[0].arrival == 0.0
    assert windowed.requests[-1].arrival == pytest.approx(kept[-1][0] - kept[0][0], abs=1e-6)

    fast, fast_report = import_azure(AZURE, ImportOptions(4096, 256, window=(600, 1200), compress=4))
    assert [(r.prompt_tokens, r.budget) for r in fast.requests] == [(r.prompt_tokens, r.budget) for r in windowed.requests]
    for f, w in zip(fast.requests, windowed.requests):
        assert f.arrival == pytest.approx(w.arrival / 4, abs=1e-6)
    assert fast_report.offered_rate == pytest.approx(4 * report.offered_rate, rel=1e-6)


def test_csv_import_with_numeric_seconds_and_caps(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("t,plen,olen,extra\n10.5,100,300,x\n11.0,5000,10,y\n12.25,4096,256,z\n\n12.25,7,257.0,w\n")
    trace, report = import_table(p, "t", "plen", "olen", CAPS)
    assert [(r.arrival, r.prompt_tokens, r.budget) for r in trace.requests] == [
        (0.0, 100, 256), (1.75, 4096, 256), (1.75, 7, 256)]
    assert (report.rows_read, report.dropped_prompt, report.clipped_budget, report.kept) == (4, 1, 2, 3)
    assert report.offered_rate == pytest.approx(2 / 1.75)
    full, report = import_table(p, "t", "plen", "olen")
    assert [(r.prompt_tokens, r.budget) for r in full.requests] == [(100, 300), (5000, 10), (4096, 256), (7, 257)]
    assert (report.dropped_prompt, report.clipped_budget, report.kept) == (0, 0, 4)
    only_prompts, report = import_table(p, "t", "plen", "olen", ImportOptions(max_prompt=4096))
    assert [r.budget for r in only_prompts.requests] == [300, 256, 257] and report.clipped_budget == 0
    assert import_note(only_prompts.meta) == "1 of 4 prompts over 4096 tokens dropped, no output cap"


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


def test_a_repeated_request_id_is_refused_at_read_naming_the_second_line(tmp_path):
    # Was left to the engine (which served one of the two) and the simulator (which named no file or line).
    p = tmp_path / "dup.csv"
    p.write_text(TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,64,p16\n1,0.55,16,64,p16\n0,0.6,16,64,p16\n")
    with pytest.raises(InputError, match=r"request id 0 is repeated \(first on line 3\)") as err:
        read_trace(p)
    assert str(p) in str(err.value) and "line 5" in str(err.value) and "'request_id'" in str(err.value)


@pytest.mark.parametrize("text, line, column", [
    (TRACE_HEADER + TRACE_COLUMNS + "0,1.0,16,64,p16\n1,0.5,16,64,p16\n", 4, "arrival_s"),  # unsorted
    (TRACE_HEADER + TRACE_COLUMNS + "0,-0.5,16,64,p16\n", 3, "arrival_s"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,12.5,64,\n", 3, "prompt_tokens"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,0,p16\n", 3, "budget"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,nan,16,64,p16\n", 3, "arrival_s"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,NaN,64,\n", 3, "prompt_tokens"),
    (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,20,64,p16\n", 3, "prompt"),  # name and length disagree
    (TRACE_HEADER + "request_id,arrival_s,prompt_tokens,prompt\n0,0.5,16,p16\n", 2, "budget"),  # missing column
    ('# {"schema": "request-trace", "version": 3}\n' + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),
    ('# {"schema": "run-record/requests", "version": 1}\n' + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),
    ("# [1]\n" + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),  # these three once raised other exceptions
    ("# " + "[" * 100_000 + "\n" + TRACE_COLUMNS, 1, None),
    ('# {"schema": "request-trace", "version": 1, "meta": 5}\n' + TRACE_COLUMNS + "0,0.5,16,64,p16\n", 1, None),
], ids=["unsorted", "negative-arrival", "non-integer", "non-positive", "nan-arrival", "nan-length",
        "prompt-mismatch", "missing-column", "unknown-version", "wrong-schema", "header-not-object", "header-too-deep",
        "meta-not-object"])
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
    ("a.csv", "ts,in,out\n1e9999999,5,6\n", 2, "ts"),  # once an uncaught decimal.Overflow
    ("a.csv", "ts,in,out\n2023-11-16 18:15:46.1,5,6\nsoon,5,6\n", 3, "ts"),
    ("a.csv", "ts,in,out\n2023-11-16 18:15:47,5,6\n2023-11-16 18:15:46.9999999,5,6\n", 3, "ts"),  # out of order
    ("a.csv", "ts,in,out\n1.0,5,6\n2023-11-16 18:15:46,5,6\n", 3, "ts"),  # seconds, then a datetime
    ("a.csv", "ts,in,out\n1.0,5,6\n2.0,5\n", 3, None),  # a short row
    ("a.jsonl", '{"ts": 1, "in": 5, "out": 6}\n\n{"ts": 2, "out": 6}\n', 3, "in"),
    ("a.jsonl", '{"ts": 1, "in": 5, "out": null}\n', 1, "out"),
    ("a.jsonl", '{"ts": 1, "in": 5, "out": 6}\n{"ts": 2,\n', 2, None),
], ids=["missing-column", "non-integer", "zero", "negative", "nan-length", "empty", "nan-time", "huge-time",
        "unparseable-time",
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
    check = ("import pkgutil, importlib, sys, servecap.traces as traces\n"
             "for m in pkgutil.iter_modules(traces.__path__):\n"
             "    if m.name != '__main__': importlib.import_module('servecap.traces.' + m.name)\n"
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
    # --force, so that the refusal is the budget's (the draw's), not the existing file's.
    assert main(["closed", "--mixed", "--n", "3", "--budget", "64", "--out", str(out), "--force"]) == 2
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert read_trace(out).trace_id in shown and "closed-uniform" in shown


def test_import_command_prints_the_report_and_records_it(tmp_path, capsys):
    src, out = tmp_path / "src.csv", tmp_path / "t.csv"
    src.write_text("when,p,o\n0,10,300\n1,9000,5\n2,20,30\n4,30,40\n")
    assert main(["import", str(src), "--timestamp", "when", "--input", "p", "--output", "o", "--window", "0:3",
                 "--compress", "2", "--max-prompt", "4096", "--max-budget", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rows kept                  2" in printed and "outside the window         1" in printed
    trace = read_trace(out)
    assert [(r.arrival, r.prompt_tokens, r.budget) for r in trace.requests] == [(0.0, 10, 256), (1.0, 20, 30)]
    assert trace.meta["report"] == {"rows_read": 4, "outside_window": 1, "dropped_prompt": 1, "clipped_budget": 1,
                                    "kept": 2, "span_s": 1.0, "offered_rate": 1.0}
    assert trace.meta["options"]["window"] == [0.0, 3.0]
    assert import_note(trace.meta) == ("1 of 4 rows outside the window left out, 1 of 3 prompts over 4096 tokens "
                                       "dropped, 1 of 2 outputs clipped to 256 tokens")
    assert trace.meta["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert json.loads(out.read_text().splitlines()[0][2:])["trace_id"] == trace.trace_id


# --- whole files and appended files ------------------------------------------------------------------

def test_a_trace_file_without_a_final_newline_keeps_its_last_request(tmp_path):
    # A trace file is written whole, so a missing final newline is not a torn write (only run records are appended).
    p = tmp_path / "t.csv"
    p.write_text(TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,64,p16\n1,0.75,256,128,p256")
    assert [(r.request_id, r.arrival, r.prompt_tokens, r.budget, r.prompt) for r in read_trace(p).requests] == [
        (0, 0.5, 16, 64, "p16"), (1, 0.75, 256, 128, "p256")]


@pytest.mark.parametrize("last", ["1,0.75,256", '1,0.75,256,128,"p256'], ids=["short", "open-quote"])
def test_a_malformed_last_row_without_a_newline_is_refused_naming_its_line(tmp_path, last):
    p = tmp_path / "t.csv"
    p.write_text(TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,64,p16\n" + last)
    with pytest.raises(InputError) as err:
        read_trace(p)
    _assert_names(err, p, 4, None)


def _bad_utf8(tmp_path: Path) -> tuple[Path, bytes]:
    p = tmp_path / "latin1.csv"
    data = (TRACE_HEADER + TRACE_COLUMNS + "0,0.5,16,64,p16\n").encode() + b"1,0.6,16,64,caf\xe9\n"
    p.write_bytes(data)
    return p, data


def test_a_trace_that_is_not_utf8_is_refused_naming_the_file_line_and_byte(tmp_path):
    p, data = _bad_utf8(tmp_path)
    with pytest.raises(InputError, match="not UTF-8") as err:
        read_trace(p)
    _assert_names(err, p, 4, None)
    assert "byte %d" % data.index(b"\xe9") in str(err.value)


def test_a_run_record_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    w = RunWriter(tmp_path / "run", {"kind": "engine"})
    w.add_many("requests", REQUEST_ROWS)
    w.close()
    with open(tmp_path / "run" / "rejected.csv", "ab") as f:
        f.write(b"9,0.5,caf\xe9\n")
    with pytest.raises(InputError, match="not UTF-8") as err:
        read_run(tmp_path / "run")
    _assert_names(err, tmp_path / "run" / "rejected.csv", 2, None)  # the column names are line 1


def test_a_cost_table_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "cost.json"
    p.write_bytes(b'{"schema": "cost-table", "device": "caf\xe9"}\n')
    with pytest.raises(InputError, match="not UTF-8") as err:
        load_cost_table(p)
    assert str(p) in str(err.value)


@pytest.mark.parametrize("read", [read_trace, load_cost_table, lambda p: import_table(p, "ts", "in", "out"),
                                  lambda p: import_lengths(p, "in", "out", 1.0, 10)],
                         ids=["trace", "cost-table", "import", "import-lengths"])
def test_a_directory_for_a_file_is_an_input_error(tmp_path, read):
    d = tmp_path / "d.csv"
    d.mkdir()
    with pytest.raises(InputError, match="is a directory") as err:
        read(d)
    assert str(d) in str(err.value)


@pytest.mark.parametrize("make", [lambda tmp_path: _bad_utf8(tmp_path)[0], lambda tmp_path: tmp_path],
                         ids=["not-utf8", "directory"])
def test_show_on_unreadable_input_prints_one_line_and_exits_2(tmp_path, capsys, make):
    p = make(tmp_path)
    assert main(["show", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(p) in err
    assert "not UTF-8" in err or "is a directory" in err


def _fail_replace(src, dst):
    raise OSError(errno.ENOSPC, "No space left on device")


def _fail_write(self, text, encoding=None):
    with open(self, "w", encoding=encoding) as f:
        f.write(text[:10])  # half of it made it to disk
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("target, patch", [("os.replace", _fail_replace), ("pathlib.Path.write_text", _fail_write)],
                         ids=["replace-fails", "disk-full"])
def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, target, patch):
    p = tmp_path / "t.csv"
    p.write_text("recorded before\n")
    monkeypatch.setattr(target, patch)
    with pytest.raises(OSError, match=f"{p}: cannot be written: the disk is full"):
        write_trace(poisson_trace(1.0, 5, 0), p)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["t.csv"] and p.read_text() == "recorded before\n"


def test_an_atomic_write_onto_a_directory_leaves_no_temporary_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "d", "text\n")
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == []


# --- never overwriting without --force -----------------------------------------------------------------

AZURE_LIKE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6800000,10,5\n2023-11-16 18:15:47.1,20,6\n"


@pytest.mark.parametrize("command", [
    ["import", "{src}", "--timestamp", "TIMESTAMP", "--input", "ContextTokens", "--output", "GeneratedTokens"],
    ["import-azure", "{src}"],
    ["import-lengths", "{src}", "--input", "ContextTokens", "--output", "GeneratedTokens", "--rate", "1"],
], ids=["import", "import-azure", "import-lengths"])
@pytest.mark.parametrize("spelling", ["same", "dot", "symlink"])
@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_an_import_never_writes_over_its_own_source(tmp_path, capsys, command, spelling, force):
    src = tmp_path / "src.csv"
    src.write_text(AZURE_LIKE)
    out = {"same": src, "dot": tmp_path / "." / "src.csv", "symlink": tmp_path / "link.csv"}[spelling]
    if spelling == "symlink":
        out.symlink_to(src)
    assert main([a.format(src=src) for a in command] + ["--out", str(out)] + force) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "being imported" in err and str(out) in err
    assert src.read_text() == AZURE_LIKE


@pytest.mark.parametrize("command", [
    ["poisson", "--rate", "2", "--n", "5"],
    ["closed", "--prompt", "p16", "--n", "2"],
    ["import", "{src}", "--timestamp", "TIMESTAMP", "--input", "ContextTokens", "--output", "GeneratedTokens"],
    ["import-azure", "{src}"],
    ["import-lengths", "{src}", "--input", "ContextTokens", "--output", "GeneratedTokens", "--rate", "1"],
], ids=["poisson", "closed", "import", "import-azure", "import-lengths"])
def test_trace_commands_refuse_to_overwrite_a_file_without_force(tmp_path, capsys, command):
    src, out = tmp_path / "src.csv", tmp_path / "t.csv"
    src.write_text(AZURE_LIKE)
    out.write_text("a trace someone recorded\n")
    argv = [a.format(src=src) for a in command] + ["--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err and str(out) in err
    assert out.read_text() == "a trace someone recorded\n"
    assert main(argv + ["--force"]) == 0
    assert len(read_trace(out)) >= 2


# --- time units ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("unit, scale", [("s", 1), ("ms", 1e3), ("us", 1e6)])
def test_numeric_timestamps_are_read_in_the_unit_given(tmp_path, capsys, unit, scale):
    src, out = tmp_path / "src.csv", tmp_path / "t.csv"
    src.write_text("t,p,o\n" + "".join(f"{(100 + s) * scale:g},5,6\n" for s in (0, 0.5, 2)))
    assert main(["import", str(src), "--timestamp", "t", "--input", "p", "--output", "o", "--time-unit", unit,
                 "--window", "0:1", "--out", str(out)]) == 0  # the window is in seconds whatever the unit
    trace = read_trace(out)
    assert [r.arrival for r in trace.requests] == [0.0, 0.5]
    assert trace.meta["options"]["time_unit"] == unit
    assert "warning" not in capsys.readouterr().err


def test_iso_datetimes_ignore_the_time_unit(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("ts,in,out\n2023-11-16 18:15:46.5,5,6\n2023-11-16 18:15:48,5,6\n")
    trace, _ = import_table(p, "ts", "in", "out", ImportOptions(time_unit="ms"))
    assert [r.arrival for r in trace.requests] == [0.0, 1.5]
    assert time_unit_warning(trace) is None


def test_a_bad_time_unit_is_refused():
    with pytest.raises(InputError, match="time unit"):
        ImportOptions(time_unit="min")


def _numeric_trace(tmp_path: Path, times: list[float], unit: str, compress: float = 1.0):
    p = tmp_path / "t.csv"
    p.write_text("t,in,out\n" + "".join(f"{t!r},5,6\n" for t in times))
    return import_table(p, "t", "in", "out", ImportOptions(time_unit=unit, compress=compress))[0]


@pytest.mark.parametrize("times, unit, expect", [
    ([5000.0 * i for i in range(100)], "s", "--time-unit ms"),  # 0.2 req/s in milliseconds, read as seconds
    ([5000.0 * i for i in range(100)], "ms", None),
    ([5e6 * i for i in range(100)], "ms", "--time-unit us"),
    ([5e9 * i for i in range(100)], "us", "check the unit"),  # nothing finer to suggest
    ([0.5 * i for i in range(100)], "us", "--time-unit ms"),  # 2 req/s in seconds, read as microseconds
    ([0.5 * i for i in range(100)], "s", None),
    ([1e-6 * i for i in range(100)], "s", "check the unit"),  # nothing coarser to suggest
    ([86400.0 * 3 * i for i in range(3)], "s", "--time-unit ms"),
    ([3600.0 * i for i in range(3)], "s", None),  # slow, but over hours: a plausible sparse trace
], ids=["ms-as-s", "ms", "us-as-ms", "slow-us", "s-as-us", "s", "fast-s", "days-apart", "hours-apart"])
def test_the_time_unit_warning_names_the_unit_that_would_fit(tmp_path, times, unit, expect):
    warning = time_unit_warning(_numeric_trace(tmp_path, times, unit))
    if expect is None:
        assert warning is None
    else:
        assert warning.startswith("warning: ") and "\n" not in warning and expect in warning, warning


def test_the_time_unit_warning_judges_the_files_rate_not_the_compressed_one(tmp_path):
    assert time_unit_warning(_numeric_trace(tmp_path, [0.1 * i for i in range(100)], "s", compress=1e5)) is None


def test_the_import_command_prints_the_time_unit_warning_and_still_writes(tmp_path, capsys):
    src, out = tmp_path / "src.csv", tmp_path / "t.csv"
    src.write_text("t,p,o\n" + "".join(f"{5000 * i},5,6\n" for i in range(100)))
    assert main(["import", str(src), "--timestamp", "t", "--input", "p", "--output", "o", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and err.count("\n") == 1 and "--time-unit ms" in err
    assert len(read_trace(out)) == 100


# --- lengths without arrival times (ShareGPT) ----------------------------------------------------------

LENGTH_ROWS = [(10, 300), (5000, 5), (20, 30), (4096, 256), (9000, 1), (7, 257)]
POOL = [(p, o) for p, o in LENGTH_ROWS if p <= 4096]


def _lengths_csv(tmp_path: Path) -> Path:
    p = tmp_path / "lengths.csv"
    p.write_text("num_prefill_tokens,num_decode_tokens,pd_ratio\n" + "".join(f"{a},{b},{a / b}\n" for a, b in LENGTH_ROWS))
    return p


def _draw(pool_size: int, n: int, seed: int) -> list[int]:
    # The documented draw, written out: raw PCG64 words of stream 3, modulo the pool's size.
    return [int(w % pool_size) for w in np.random.PCG64(np.random.SeedSequence([seed, 3])).random_raw(n)]


def test_lengths_are_drawn_from_the_capped_rows_with_poisson_arrivals(tmp_path):
    src = _lengths_csv(tmp_path)
    trace, report = import_lengths(src, "num_prefill_tokens", "num_decode_tokens", rate=2.0, n=50, seed=3,
                                   max_prompt=4096, max_budget=256)
    drawn = [POOL[i] for i in _draw(len(POOL), 50, 3)]
    assert [(r.request_id, r.prompt_tokens, r.budget, r.prompt) for r in trace.requests] == [
        (i, p, min(o, 256), "") for i, (p, o) in enumerate(drawn)]
    assert [r.arrival for r in trace.requests] == poisson_arrivals(2.0, 50, 3)
    # Pinned once: the draw must not change across NumPy versions.
    assert [r.prompt_tokens for r in trace.requests[:8]] == [7, 4096, 4096, 4096, 7, 4096, 4096, 20]
    clipped = sum(o > 256 for _, o in drawn)
    assert (report.rows_read, report.dropped_prompt, report.pool, report.drawn, report.clipped_budget) == (
        6, 2, 4, 50, clipped)
    assert report.offered_rate == trace.offered_rate and report.span_s == trace.span
    assert trace.meta["kind"] == "lengths"
    assert trace.meta["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert trace.meta["options"] == {"max_prompt": 4096, "max_budget": 256, "rate": 2.0, "n": 50, "seed": 3}
    assert trace.meta["report"]["clipped_budget"] == clipped
    assert import_note(trace.meta) == (f"2 of 6 prompts over 4096 tokens dropped, {clipped} of 50 drawn outputs "
                                       f"clipped to 256 tokens")


def test_lengths_are_drawn_from_every_row_at_full_length_by_default(tmp_path):
    trace, report = import_lengths(_lengths_csv(tmp_path), "num_prefill_tokens", "num_decode_tokens", rate=2.0, n=50,
                                   seed=3)
    drawn = [LENGTH_ROWS[i] for i in _draw(len(LENGTH_ROWS), 50, 3)]
    assert [(r.prompt_tokens, r.budget) for r in trace.requests] == drawn
    assert (report.dropped_prompt, report.pool, report.clipped_budget) == (0, len(LENGTH_ROWS), 0)


def test_lengths_draw_is_uniform_and_the_same_requests_at_every_rate(tmp_path):
    src = _lengths_csv(tmp_path)
    slow, _ = import_lengths(src, "num_prefill_tokens", "num_decode_tokens", rate=1.0, n=4000, seed=5, max_prompt=4096)
    fast, _ = import_lengths(src, "num_prefill_tokens", "num_decode_tokens", rate=4.0, n=4000, seed=5, max_prompt=4096)
    assert [(r.prompt_tokens, r.budget) for r in slow.requests] == [(r.prompt_tokens, r.budget) for r in fast.requests]
    for s, f in zip(slow.requests, fast.requests):
        assert f.arrival == pytest.approx(s.arrival / 4, abs=1e-6)
    counts = Counter(r.prompt_tokens for r in slow.requests)
    assert set(counts) == {p for p, _ in POOL} and all(abs(c - 1000) < 150 for c in counts.values()), counts


def test_import_lengths_command_gives_byte_identical_files_and_prints_the_report(tmp_path, capsys):
    src = _lengths_csv(tmp_path)
    outs = [tmp_path / "a.csv", tmp_path / "b" / "a.csv"]
    for out in outs:
        assert main(["import-lengths", str(src), "--input", "num_prefill_tokens", "--output", "num_decode_tokens",
                     "--rate", "2", "--n", "30", "--seed", "4", "--max-prompt", "4096", "--max-budget", "100",
                     "--out", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    printed = capsys.readouterr().out
    assert "rows drawn from            4" in printed and "requests drawn             30" in printed
    trace = read_trace(outs[0])
    assert len(trace) == 30 and max(r.budget for r in trace.requests) == 100
    assert trace.meta["options"]["max_budget"] == 100


@pytest.mark.parametrize("text, kwargs, match", [
    ("in,out\n5,6\n7,x\n", {}, "line 3, column 'out'"),
    ("in,out\n", {}, "no requests"),
    ("in,out\n5000,6\n", {"max_prompt": 4096}, "over the cap"),
    ("in,out\n5,6\n", {"rate": 0.0}, "rate"),
    ("in,out\n5,6\n", {"n": 0}, "n must be"),
    ("in,out\n5,6\n", {"seed": -1}, "seed must be"),
], ids=["bad-value", "no-rows", "all-over-cap", "zero-rate", "zero-n", "negative-seed"])
def test_bad_lengths_input_is_refused(tmp_path, text, kwargs, match):
    p = tmp_path / "l.csv"
    p.write_text(text)
    with pytest.raises(InputError, match=match):
        import_lengths(p, "in", "out", **{"rate": 1.0, "n": 10, **kwargs})


@needs_sharegpt
def test_sharegpt_lengths_import_draws_only_rows_within_the_caps(tmp_path):
    with open(SHAREGPT, newline="") as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    pool = [(p, o) for p, o in rows if p <= 4096]
    assert len(rows) == 30731  # SOURCES.md's row count
    trace, report = import_lengths(SHAREGPT, "num_prefill_tokens", "num_decode_tokens", rate=5.0, n=2000, seed=0,
                                   max_prompt=4096, max_budget=256)
    assert (report.rows_read, report.dropped_prompt, report.pool, len(trace)) == (
        len(rows), len(rows) - len(pool), len(pool), 2000)
    drawn = [pool[i] for i in _draw(len(pool), 2000, 0)]
    assert [(r.prompt_tokens, r.budget) for r in trace.requests] == [(p, min(o, 256)) for p, o in drawn]
    assert report.offered_rate == pytest.approx(5.0, rel=0.1)
    again, _ = import_lengths(SHAREGPT, "num_prefill_tokens", "num_decode_tokens", rate=5.0, n=2000, seed=0,
                              max_prompt=4096, max_budget=256)
    assert write_trace(again, tmp_path / "b.csv").read_bytes() == write_trace(trace, tmp_path / "a.csv").read_bytes()
