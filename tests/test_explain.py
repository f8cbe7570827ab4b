"""`python -m traces explain` and `timeline` on hand-made run records whose splits are worked out in the comments.

The hand-made run uses times that are exact binary fractions (multiples of 1/64 s), so sums of its parts are
exact and the assertions use ==.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
from helpers import constant_table, write_table

import servecap.sim.cli

from servecap import sim
from servecap.costs.model import CostModel
from servecap.core.config import ServingConfig
from servecap.sim import SimConfig, simulate
from servecap.traces import metrics
from servecap.traces.cli import main
from servecap.traces.explain import PARTS, compare, explain
from servecap.traces.explain_report import report, report_pair
from servecap.traces.records import RunWriter, read_run
from servecap.traces.timeline import row_slots, timeline
from servecap.traces.workload import poisson_trace

META = {"kind": "engine", "backend": "paged", "prefill": "padded", "max_batch": 2, "pool_blocks": 100,
        "trace": {"kind": "poisson", "n": 3, "rate": 1.0, "seed": 0}}


def prefill(w, step, rows, padded_len, real, tokens, start, end, group, admitted):
    w.add("steps", (step, "prefill", rows, padded_len, real, tokens, rows * padded_len ** 2, 0, 0, 0, start, end,
                    group, admitted, 0, 0, 0, 0, 0))


def decode(w, step, rows, start, end, retired=0, kv_tokens=0):
    w.add("steps", (step, "decode", rows, 0, 0, 0, 0, kv_tokens, 0, 0, start, end, -1, 0, retired, 0, 0, 0, 0))


def hand_run(out_dir=None, close=True):
    """Three requests through two rows.

    r0 (prompt 200) arrives at 0, r1 (prompt 100) at 1/16; the pass at 1/8 admits both (queue depth 2) and
    prefills them padded to 200: 400 positions for 300 real tokens, 1/8 -> 1/2 (3/8 s: 9/32 real, 3/32 padding).
    Decode steps of 1/8 s: s1-s3 with 2 rows; s4 computes 7/8 -> 1 (r1 finishes at 1) and retires r1 by 9/8
    (1/8 s of retirement over the 1/8 s median of s1-s3). s5-s7 with 1 row; s8 computes 3/2 -> 13/8 (r0 finishes
    at 13/8) and retires it by 7/4. Idle until r2 (prompt 64, no padding) arrives at 2 and is admitted at once:
    prefill 2 -> 17/8, then nothing runs until its decode step 35/16 -> 37/16, where it finishes and the
    record's wall time ends.

    wall 37/16; idle 1/8 + 1/4 = 3/8; prefill 9/32 + 1/8 = 13/32; padding 3/32; decode 3/8 + 1/8 + 3/8 + 1/8 +
    1/8 = 9/8; retire 1/4; untimed 1/16 (r2 holds a row, no step runs).
    """
    w = RunWriter(out_dir, META)
    # request_id, arrival, admitted, admit_step, group_id, group_size, first_token, finished, prompt, output, blocks
    w.add("requests", (1, 1 / 16, 1 / 8, 0, 0, 2, 1 / 2, 1.0, 100, 5, 3, 0, 0, 0, 0))
    w.add("requests", (0, 0.0, 1 / 8, 0, 0, 2, 1 / 2, 13 / 8, 200, 9, 4, 0, 0, 0, 0))
    w.add("requests", (2, 2.0, 2.0, 8, 1, 1, 17 / 8, 37 / 16, 64, 2, 2, 0, 0, 0, 0))
    prefill(w, 0, 2, 200, 300, 400, 1 / 8, 1 / 2, 0, 2)
    for i in range(3):
        decode(w, i, 2, 1 / 2 + i / 8, 5 / 8 + i / 8)
    decode(w, 3, 2, 7 / 8, 9 / 8, retired=1)
    for i in range(3):
        decode(w, 4 + i, 1, 9 / 8 + i / 8, 5 / 4 + i / 8)
    decode(w, 7, 1, 3 / 2, 7 / 4, retired=1)
    prefill(w, 8, 1, 64, 64, 64, 2.0, 17 / 8, 1, 1)
    decode(w, 8, 1, 35 / 16, 37 / 16, retired=1)
    if close:
        w.close()
    return w


def test_split_of_the_hand_made_run():
    e = explain(hand_run().record(), windows=2)
    assert (e.start, e.end, e.wall) == (0.0, 37 / 16, 37 / 16)
    assert e.split == {"decode": 9 / 8, "prefill": 13 / 32, "padding": 3 / 32, "retire": 1 / 4, "untimed": 1 / 16,
                       "idle": 3 / 8}
    assert sum(e.split.values()) == e.wall
    assert e.notes == []


def test_windows_of_the_hand_made_run():
    w = explain(hand_run().record(), windows=2).windows
    # Window 1, 0 -> 37/32: idle 1/8, the first prefill, s1-s3, s4's compute and retirement, s5's first 1/32.
    assert list(w["end"]) == [37 / 32, 37 / 16]
    assert list(w["arrivals"]) == [2, 1]
    assert list(w["offered_rate"]) == [2 / (37 / 32), 1 / (37 / 32)]
    assert [w.loc[0, p] for p in PARTS] == [3 / 8 + 1 / 8 + 1 / 32, 9 / 32, 3 / 32, 1 / 8, 0.0, 1 / 8]
    assert [w.loc[1, p] for p in PARTS] == [3 / 32 + 2 / 8 + 1 / 8 + 1 / 8, 1 / 8, 0.0, 1 / 8, 1 / 16, 1 / 4]
    # Rows held: 2 from 1/8 to 1, then 1 to 13/8; in window 1, 2 x 7/8 + 1 x (37/32 - 1).
    assert w.loc[0, "rows_mean"] == (2 * 7 / 8 + 5 / 32) / (37 / 32)


def test_rows_groups_and_retirement_of_the_hand_made_run():
    rec = hand_run().record()
    e = explain(rec, windows=1)
    # Rows held: none 0 -> 1/8 and 13/8 -> 2; one 1 -> 13/8 and 2 -> 37/16; two 1/8 -> 1.
    wall = 37 / 16
    assert list(e.rows) == [(1 / 8 + 3 / 8) / wall, (5 / 8 + 5 / 16) / wall, (7 / 8) / wall]
    assert e.figures["rows_mean"] == pytest.approx(metrics.occupancy(rec)["mean_running_rows"], rel=1e-15)
    assert (e.figures["rows_p50"], e.figures["rows_p95"], e.figures["rows_full_share"]) == (1, 2, (7 / 8) / wall)
    # Group 0: depth 2 (r0, r1 arrived, none admitted), 100 padded positions over 300 real; group 1: depth 1.
    g = metrics.groups_at_admission(rec)
    assert list(g["depth"]) == [2, 1] and list(g["size"]) == [2, 1]
    assert list(g["waste"]) == [100 / 300, 0.0] and list(g["padding_s"]) == [3 / 32, 0.0]
    by = e.groups
    assert list(by["depth_lo"]) == [1, 2] and list(by["depth_hi"]) == [1, 3] and list(by["groups"]) == [1, 1]
    # Retirement: s4 and s8 take 1/8 s over their references, s9 (one row, 1/8 s) none; three rows retired.
    r = metrics.retire_overhead(rec)
    assert list(r["overhead"]) == [1 / 8, 1 / 8, 0.0] and list(r["reference"]) == [1 / 8] * 3
    assert e.figures["retired_rows"] == 3 and e.figures["retire_ms_per_row"] == 250 / 3


def test_retire_reference_is_the_median_of_the_nearest_same_row_steps():
    w = RunWriter(None, {})
    # Ten one-row steps at starts 0..9 lasting 0.1 + 0.01 i; a retiring one-row step at 9.5 lasting 0.5; a
    # retiring two-row step with no two-row step to compare with.
    for i in range(10):
        decode(w, i, 1, float(i), i + 0.1 + 0.01 * i)
    decode(w, 10, 1, 9.5, 10.0, retired=1)
    decode(w, 11, 2, 10.0, 10.25, retired=2)
    r = metrics.retire_overhead(w.record())
    # The 8 nearest to 9.5: starts 2..9, durations 0.12 .. 0.19, median 0.155.
    assert r["reference"].iloc[0] == pytest.approx(0.155, abs=1e-12)
    assert r["overhead"].iloc[0] == pytest.approx(0.5 - 0.155, abs=1e-12)
    assert math.isnan(r["reference"].iloc[1]) and r["overhead"].iloc[1] == 0.0
    # Equally near steps either side: the earlier one wins the last place.
    w = RunWriter(None, {})
    for i, d in enumerate((0.1, 0.3, 0.2)):
        decode(w, i, 1, float(i), i + d)
    decode(w, 3, 1, 1.0, 1.5, retired=1)
    assert metrics.retire_overhead(w.record(), neighbours=2)["reference"].iloc[0] == pytest.approx(0.2)  # (0.1+0.3)/2


def test_simulated_retirement_is_recovered():
    # Constant costs: every decode step 0.01 s, retirement 0.002 s a row; the estimate gets the table's back.
    table = constant_table(decode_s=0.01, retire_s=0.002)
    rec = simulate(poisson_trace(20.0, 40, 0), CostModel(table), SimConfig(ServingConfig(max_batch=8), detail="steps")).record
    e = explain(rec)
    assert e.figures["retire_ms_per_row"] == pytest.approx(2.0, rel=1e-9)
    assert sum(e.split.values()) == pytest.approx(e.wall, rel=1e-12)
    p = rec.steps[rec.steps["kind"] == "prefill"]
    assert e.split["prefill"] + e.split["padding"] == pytest.approx(float((p["end"] - p["start"]).sum()), rel=1e-12)
    waste = ((p["tokens"] - p["prompt_tokens"]) / p["tokens"] * (p["end"] - p["start"])).sum()
    assert e.split["padding"] == pytest.approx(float(waste), rel=1e-12)


def test_compare_two_records():
    a = explain(hand_run().record())
    w = hand_run(close=False)
    b = explain(w.record())
    c = compare(a, b)
    assert c.loc["wall_s", "diff"] == 0.0 and c.loc["wall_s", "rel"] == 0.0
    text = report_pair(a, b, ("A", "B"))
    assert "B - A" in text and "retire overhead (estimated)" in text
    assert "where the time goes" in report(a, "A")


def test_groups_by_depth_bins():
    import pandas as pd
    g = pd.DataFrame({"depth": [1, 2, 3, 4, 7, 8], "size": [1, 2, 2, 3, 5, 8], "waste": [0, .5, .5, 1, 1, 2],
                      "padding_s": [0, .1, .1, .2, .2, .4]})
    by = metrics.groups_by_depth(g)
    assert list(by["depth_lo"]) == [1, 2, 4, 8] and list(by["depth_hi"]) == [1, 3, 7, 15]
    assert list(by["groups"]) == [1, 2, 2, 1] and list(by["size_mean"]) == [1, 2, 4, 8]
    assert list(by["padding_s"]) == pytest.approx([0, .2, .4, .4])


# ---- the CLI: exit codes and one-line errors ------------------------------------------------------------------
def _error_line_of(err: str) -> str:
    assert len(err.strip().splitlines()) == 1, err
    return err


def _error_line(capsys) -> str:
    return _error_line_of(capsys.readouterr().err)


def test_explain_cli(tmp_path, capsys):
    run = tmp_path / "run"
    hand_run(run)
    png = tmp_path / "x.png"
    assert main(["explain", str(run), str(run), "--windows", "2", "--png", str(png)]) == 0
    out = capsys.readouterr()
    assert "where the time goes" not in out.out and "B - A" in out.out and out.err == ""
    assert png.stat().st_size > 0


def test_explain_cli_refuses_what_is_not_a_record(tmp_path, capsys):
    assert main(["explain", str(tmp_path)]) == 2
    assert "not a run record" in _error_line(capsys)
    run = tmp_path / "run"
    hand_run(run)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "version": 9}))
    for command in (["explain", str(run)], ["timeline", str(run), "--out", str(tmp_path / "t.json")]):
        assert main(command) == 2
        assert "v9" in _error_line(capsys)
    assert main(["explain", str(tmp_path), str(tmp_path), str(tmp_path)]) == 2
    assert "one or two" in _error_line(capsys)
    hand_run(tmp_path / "ok")
    assert main(["timeline", str(tmp_path / "ok"), "--out", str(tmp_path / "t.json"), "--names", "a,b"]) == 2
    assert "one name per record" in _error_line(capsys)


def test_unfinished_record_is_explained_with_a_warning(tmp_path, capsys):
    run = tmp_path / "run"
    hand_run(run, close=False)
    assert json.loads((run / "meta.json").read_text())["status"] == "running"
    assert main(["explain", str(run)]) == 0
    out = capsys.readouterr()
    assert "where the time goes" in out.out
    assert out.err.startswith("warning: ") and "unfinished" in _error_line_of(out.err)
    assert main(["timeline", str(run), "--out", str(tmp_path / "t.json")]) == 0
    assert "unfinished" in capsys.readouterr().err


# ---- the timeline ----------------------------------------------------------------------------------------------
def _check_events(doc: dict) -> list[dict]:
    events = doc["traceEvents"]
    last = defaultdict(lambda: -math.inf)
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert isinstance(e["args"], dict) and e["args"]
        assert e["ts"] >= last[e["pid"], e["tid"]], e  # monotone per track
        last[e["pid"], e["tid"]] = e["ts"]
    return events


def test_timeline_of_two_records(tmp_path, capsys):
    real, simulated = tmp_path / "real", tmp_path / "sim"
    hand_run(real)
    w = RunWriter(simulated, {**META, "kind": "sim"})
    for t in ("requests", "steps"):
        w.add_many(t, getattr(hand_run().record(), t).itertuples(index=False, name=None))
    w.close()
    out = tmp_path / "t.json"
    assert main(["timeline", str(real), str(simulated), "--out", str(out), "--names", "real,sim"]) == 0
    events = _check_events(json.loads(out.read_text()))
    assert {e["pid"] for e in events} == {1, 2}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "real", 2: "sim"}
    steps = [e for e in events if e["pid"] == 1 and e["tid"] == 0 and e["ph"] == "X"]
    # prefill, 4 two-row decode steps, 4 one-row decode steps, prefill, 1 decode step
    assert [(e["name"], e["args"].get("steps")) for e in steps] == \
        [("prefill", None), ("decode", 4), ("decode", 4), ("prefill", None), ("decode", 1)]
    assert steps[0]["ts"] == 125000.0 and steps[0]["dur"] == 375000.0
    assert steps[0]["args"]["tokens"] == 400 and steps[0]["args"]["prompt_tokens"] == 300
    assert steps[1]["args"]["retired"] == 1 and steps[1]["dur"] == 625000.0
    # r0 and r1 take rows 0 and 1; r2 comes after both have left and takes row 0.
    rows = {e["name"]: e["tid"] for e in events if e["pid"] == 1 and e["ph"] == "X" and e["tid"] > 0}
    assert rows == {"request 0": 1, "request 1": 2, "request 2": 1}
    free = [(e["ts"], e["args"]["blocks"]) for e in events if e["pid"] == 1 and e["name"] == "free KV blocks"]
    assert free == [(0.0, 100), (125000.0, 93), (1e6, 96), (1625000.0, 100), (2e6, 98), (2312500.0, 100)]
    depth = [(e["ts"], e["args"]["requests"]) for e in events if e["pid"] == 1 and e["name"] == "queue depth"]
    assert depth == [(0.0, 1), (62500.0, 2), (125000.0, 0), (2e6, 0)]
    with_steps = timeline([read_run(real)], every_step=True)["traceEvents"]
    assert sum(e["ph"] == "X" and e["tid"] == 0 for e in with_steps) == 11


def test_row_slots_take_the_lowest_free_row():
    w = RunWriter(None, {})
    # r0 0-4, r1 1-2, r2 2-3 (takes r1's row, freed at 2), r3 3-5 (row 1 again: rows 0 and 1 are r0 and free)
    for rid, (a, f) in enumerate(((0, 4), (1, 2), (2, 3), (3, 5))):
        w.add("requests", (rid, a, a, 0, rid, 1, a, f, 16, 2, 1, 0, 0, 0, 0))
    assert list(row_slots(w.record().requests)) == [0, 1, 1, 1]


def test_sim_run_writes_trace_events(tmp_path, capsys):
    table = write_table(constant_table(), tmp_path / "table.json")
    out = tmp_path / "t.json"
    assert sim.cli.main(["run", "--rate", "5", "--n", "10", "--table", str(table), "--trace-events", str(out)]) == 0
    events = _check_events(json.loads(out.read_text()))
    assert {e["pid"] for e in events} == {1}
    assert any(e["name"] == "decode" for e in events)  # the steps are kept for the timeline without --out
