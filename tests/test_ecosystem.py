"""Issue 26, items 1-3: the ecosystem's units and names (ms, ITL, E2EL, --percentiles, --slo NAME:MS,
--save-result), bursty and ramped arrivals, and `sim capacity` by search against the sweep's grid bracket."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
from helpers import T1_REFIT

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.costs.model import CostModel
from servecap.sim import capacity, sweep
from servecap.sim.cli import main
from servecap.sim.inputs import load_table
from servecap.sim.simulator import SimConfig, simulate
from servecap.sim.sweep import Workload, run_sweep
from servecap.traces import cli as traces_cli
from servecap.traces.errors import InputError
from servecap.traces.latency import itl_gaps, latency_ms, parse_percentiles
from servecap.traces.metrics import summary
from servecap.traces.slo import parse_slo, parse_slos
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import ARRIVAL_DECIMALS, _raw, poisson_arrivals, poisson_trace, ramped


def _exit(argv: list[str]) -> int:
    """sim's exit status, whether the refusal came from argparse (SystemExit) or from the command."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def table():
    return load_table(None)


@pytest.fixture(scope="module")
def token_run(table):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate(poisson_trace(25, 300, 0), CostModel(table), SimConfig(detail="tokens")).record


# 1. units and names

def test_latencies_are_the_metrics_modules_figures_in_ms(token_run):
    lat, s = latency_ms(token_run, (50, 95)), summary(token_run, 25)
    for metric, key in (("ttft", "ttft"), ("queue_wait", "queue_wait"), ("tpot", "tpot")):
        assert lat[f"p50_{metric}_ms"] == pytest.approx(s[f"{key}_p50"] * 1000, rel=1e-12)
    assert lat["p95_ttft_ms"] == pytest.approx(s["ttft_p95"] * 1000, rel=1e-12)
    req = token_run.requests
    assert lat["mean_e2el_ms"] == pytest.approx(((req.finished - req.arrival) * 1000).mean(), rel=1e-12)


def test_itl_pools_every_gap_and_its_mean_needs_no_token_records(token_run):
    gaps = itl_gaps(token_run)
    assert len(gaps) == int((token_run.requests.output_tokens - 1).sum())
    with_tokens = latency_ms(token_run)
    without = latency_ms(replace(token_run, tokens=token_run.tokens.iloc[:0]))
    assert with_tokens["itl_source"] == "tokens" and without["itl_source"] == "requests"
    assert without["mean_itl_ms"] == pytest.approx(with_tokens["mean_itl_ms"], rel=1e-9)
    assert with_tokens["p99_itl_ms"] == pytest.approx(np.percentile(gaps, 99) * 1000)
    assert without["p99_itl_ms"] is None  # not invented without the gaps


def test_percentiles_parse_and_refuse():
    assert parse_percentiles("99,50,90,95,50") == (50, 90, 95, 99)
    for bad in ("0", "101", "x", "50,,99"):
        with pytest.raises(ValueError, match="percentile"):
            parse_percentiles(bad)


def test_run_prints_ms_with_every_latency_and_the_chosen_percentiles(capsys):
    assert main(["run", "--rate", "20", "--n", "150", "--percentiles", "50,99.9"]) == 0
    out = capsys.readouterr().out
    assert "ms" in out and "p99.9" in out and "p90" not in out
    for label in ("queue wait", "TTFT", "TPOT", "ITL", "E2EL"):
        assert f"\n  {label}" in out
    assert _exit(["run", "--rate", "20", "--percentiles", "0"]) == 2


@pytest.mark.parametrize("summary_, said", [
    (dict(served_rate=27.19, expected_rate=27.51, trend_rise_s=0.0005, served_ok=True, stable=True),
     "stable (served 98.8% of the offered rate; queue wait rose 0.5 ms over the run)"),
    (dict(served_rate=44.34, expected_rate=45.66, trend_rise_s=2.6351, served_ok=True, stable=False),
     "NOT stable (served 97.1% of the offered rate; queue wait rose 2,635.1 ms over the run, past the 1,000 ms "
     "allowed)"),
    (dict(served_rate=2.82, expected_rate=2.91, trend_rise_s=-0.00001, served_ok=False, stable=False),
     "NOT stable (served 96.9% of the offered rate, under the 97% needed; queue wait did not rise over the run)"),
    (dict(served_rate=10.0, expected_rate=10.0, trend_rise_s=-0.3, served_ok=True, stable=True),
     "stable (served 100.0% of the offered rate; queue wait fell 300.0 ms over the run)"),
])
def test_run_says_which_rule_made_its_stability_verdict_in_ms(summary_, said):
    from servecap.traces.metrics import stability_said
    assert stability_said(summary_) == said


def test_max_num_seqs_is_vllms_name_for_max_batch_in_every_command():
    from servecap.calibrate.cli import parser as calibrate_parser
    from servecap.engine.cli import parser as engine_parser
    from servecap.sim.cli import parser as sim_parser
    for parse, argv, want in ((sim_parser, ["run", "--max-num-seqs", "8"], 8),
                              (sim_parser, ["sweep", "--max-num-seqs", "8,24"], [8, 24]),
                              (sim_parser, ["capacity", "--max-num-seqs", "8"], 8),
                              (engine_parser, ["run", "--rate", "1", "--max-num-seqs", "8"], 8),
                              (calibrate_parser, ["--out", "t.json", "--max-num-seqs", "8"], 8)):
        assert parse().parse_args(argv).max_batch == want


def test_slo_takes_vllms_milliseconds_and_keeps_seconds():
    assert parse_slo("ttft:500").limit_s == 0.5 and parse_slo("ttft:500").percentile is None
    assert parse_slo("ttft_p99:250") == parse_slo("ttft_p99=0.25")
    assert parse_slo("ttft=500").limit_s == 500  # the old form stays seconds
    assert [s.limit_s for s in parse_slos("ttft:500,tpot:50")] == [0.5, 0.05]
    with pytest.raises(Exception, match="milliseconds"):
        parse_slo("ttft:-1")


@pytest.mark.parametrize("text, limit_s", [("ttft_p95=500ms", 0.5), ("ttft:0.5s", 0.5), ("tpot = 50 MS", 0.05),
                                           ("e2e:20 s", 20.0), ("ttft=2s", 2.0)])
def test_slo_value_that_names_its_unit_is_taken_in_it_under_either_sign(text, limit_s):
    assert parse_slo(text).limit_s == pytest.approx(limit_s)


@pytest.mark.parametrize("text, unit", [("ttft=-5ms", "milliseconds"), ("ttft:0s", "seconds"), ("ttft=ms", "millis"),
                                        ("ttft=5min", "seconds"), ("ttft=5ms0", "seconds")])
def test_slo_with_a_bad_value_or_unit_is_refused_naming_the_unit(text, unit):
    with pytest.raises(InputError, match=unit):
        parse_slo(text)


def test_run_states_slo_limits_in_ms(capsys):
    assert main(["run", "--rate", "20", "--n", "150", "--slo", "ttft_p99:500"]) == 0
    out = capsys.readouterr().out
    assert "ttft <= 500 ms (and its p99)" in out and "(limit 500 ms)" in out


def test_save_result_has_vllms_keys_and_provenance(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["run", "--rate", "20", "--n", "150", "--seed", "3", "--save-result", str(path),
                 "--slo", "ttft:500"]) == 0
    doc = json.loads(path.read_text())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "completed", "duration",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms",
                "mean_e2el_ms", "p95_queue_wait_ms", "request_goodput", "table_id", "seed", "trace_id", "git_commit",
                "config"):
        assert key in doc, key
    assert doc["completed"] == 150 and doc["seed"] == 3 and doc["itl_source"] == "tokens"
    assert doc["trace_id"] == poisson_trace(20, 150, 3).trace_id
    assert doc["request_throughput"] == pytest.approx(doc["completed"] / doc["duration"])
    assert doc["goodput_slos_ms"] == {"ttft": 500.0}
    capsys.readouterr()
    assert main(["run", "--rate", "20", "--n", "150", "--save-result", str(path)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err


# 2. bursty and ramped arrivals

def _old_poisson_arrivals(rate, n, seed):
    """poisson_arrivals as it was before --burstiness (commit ad4a531)."""
    u = ((_raw(seed, 2, n) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return [round(float(t), ARRIVAL_DECIMALS) for t in np.cumsum(-np.log(u) / rate)]


def test_burstiness_one_is_todays_poisson_trace_byte_for_byte(tmp_path):
    assert poisson_arrivals(7.5, 500, 4, burstiness=1.0) == _old_poisson_arrivals(7.5, 500, 4)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert traces_cli.main(["poisson", "--rate", "7.5", "--n", "300", "--seed", "4", "--out", str(a)]) == 0
    assert traces_cli.main(["poisson", "--rate", "7.5", "--n", "300", "--seed", "4", "--burstiness", "1",
                            "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert [r.arrival for r in read_trace(a).requests] == _old_poisson_arrivals(7.5, 300, 4)


@pytest.mark.parametrize("b", [0.25, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv2_one_over_burstiness(b):
    t = np.asarray(poisson_arrivals(10.0, 40_000, 1, burstiness=b))
    gaps = np.diff(np.concatenate(([0.0], t)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / b, rel=0.1)
    trace = poisson_trace(10.0, 100, 1, burstiness=b)
    assert trace.meta["kind"] == "gamma" and trace.meta["burstiness"] == b
    assert [(r.prompt, r.budget) for r in trace.requests] == \
        [(r.prompt, r.budget) for r in poisson_trace(10.0, 100, 1).requests]  # the same requests, other times


def test_ramp_up_follows_the_integrated_linear_rate():
    s, rate = 100.0, 50.0
    t = np.asarray(poisson_arrivals(rate, 20_000, 2, ramp_up_s=s))
    for at in (30.0, 60.0, 100.0, 200.0):
        want = rate * at ** 2 / (2 * s) if at <= s else rate * (at - s / 2)
        assert abs((t <= at).sum() - want) <= 4 * math.sqrt(want)  # four Poisson standard deviations
    assert list(ramped(np.array([0.0, s / 2, s]), s)) == [0.0, s, 1.5 * s]  # continuous at the ramp's end
    assert np.all(np.diff(t) >= 0)


def test_arrival_options_reach_sweep_points_and_are_refused_for_trace_files(tmp_path, capsys):
    w = Workload(100, 0, burstiness=0.5, ramp_up_s=5)
    assert w.at(10).trace_id == poisson_trace(10, 100, 0, 0.5, 5).trace_id != poisson_trace(10, 100, 0).trace_id
    trace = tmp_path / "t.jsonl"
    assert traces_cli.main(["poisson", "--rate", "5", "--n", "50", "--out", str(trace)]) == 0
    capsys.readouterr()
    assert main(["run", "--trace", str(trace), "--burstiness", "0.5"]) == 2
    assert main(["sweep", "--trace", str(trace), "--ramp-up-s", "10", "--out", str(tmp_path / "s")]) == 2
    assert "burstiness" in capsys.readouterr().err


# 3. sim capacity

CONFIG = ServingConfig(max_batch=16, pool=PoolSize(gib=4.0))
N = 200


def _setup(table, slos=()):
    sweep._init(table, False, Workload(N, 0), None, slos)


@pytest.mark.parametrize("slos", [(), parse_slos("ttft_p99:300")], ids=["stability", "slo"])
def test_bisection_lies_inside_the_sweeps_bracket(table, slos):
    _setup(table, slos)
    found = capacity.max_rate(CONFIG, 0, slos, rel_tol=0.02)
    assert found.answer is not None and found.bound is not None
    assert found.bound - found.answer <= 0.02 * found.bound
    grid = [round(found.answer * f, 3) for f in (0.5, 0.75, 0.9, 1.1, 1.3, 1.6, 2.0)]
    results, _ = run_sweep(table, [CONFIG], grid, Workload(N, 0), jobs=1, progress=False, slos=slos)
    lo, hi = results[0].slo_bracket if slos else results[0].bracket
    assert lo is not None and hi is not None
    assert lo <= found.answer < hi
    # every probe's verdict is the sweep's at that rate
    rate, held = found.probes[-1]
    again, _ = run_sweep(table, [CONFIG], [rate], Workload(N, 0), jobs=1, progress=False, slos=slos)
    assert capacity.holds(again[0].rows[0], slos) == held


def test_fewest_replicas_is_the_smallest_count_that_holds(table):
    _setup(table)
    rate = 2.5 * capacity.max_rate(CONFIG, 0, (), rel_tol=0.05).answer
    found = capacity.fewest_replicas(CONFIG, rate, 0, ())
    k = found.answer
    assert k is not None and k >= 2
    held = dict(found.probes)
    below = held[k - 1] if k - 1 in held else capacity.holds(sweep._point(replace(CONFIG, replicas=k - 1), rate, 0)[0],
                                                             ())
    assert held[k] and not below


def test_capacity_cli_band_and_windows(tmp_path, capsys):
    assert main(["capacity", "--n", str(N), "--max-batch", "16", "--seeds", "0-1", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "seed 0: highest rate that holds" in out and "across 2 seeds: min" in out
    # a trace that is quiet for 100 s, then four times busier
    quiet, busy = poisson_trace(5, 450, 1), poisson_trace(20, 1800, 2)
    path = tmp_path / "day.jsonl"
    from servecap.traces.trace_io import write_trace
    from servecap.traces.workload import length_trace
    reqs = [(r.arrival, r.prompt_tokens, r.budget) for r in quiet.requests] + \
        [(100.0 + r.arrival, r.prompt_tokens, r.budget) for r in busy.requests]
    write_trace(length_trace(reqs), path)
    assert main(["capacity", "--trace", str(path), "--window-s", "100", "--max-batch", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("window ")]
    counts = [int(line.split("-> ")[1].split()[0]) for line in lines]
    assert len(counts) >= 2 and counts[1] > counts[0] >= 1
    # Replica-hours: each window's count for its time (the last one ends with the trace), against the max throughout.
    t0, end = reqs[0][0], max(a for a, _, _ in reqs)
    spans = [100.0] * (len(counts) - 1) + [end - t0 - 100.0 * (len(counts) - 1)]
    hours = [line for line in out if line.startswith("replica-hours")][0].split()  # printed to 3 figures
    assert float(hours[4]) == pytest.approx(sum(c * t for c, t in zip(counts, spans)) / 3600, rel=5e-3)
    assert float(hours[8]) == pytest.approx(max(counts) * (end - t0) / 3600, rel=5e-3)
    assert _exit(["capacity", "--window-s", "100"]) == 2


def test_capacity_cli_out_records_every_probe_and_how_it_was_run_and_keeps_what_is_there(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert main(["capacity", "--n", str(N), "--max-batch", "16", "--seeds", "0-1", "--jobs", "1",
                 "--out", str(out)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("seed ")]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "capacity" and doc["configuration"]["max_batch"] == 16 and doc["workload"]["seeds"] == [0, 1]
    assert doc["git_commit"] and doc["command"].startswith("python -m sim capacity") and doc["table"]["id"]
    for search, line in zip(doc["searches"], said):
        assert line.startswith(f"seed {search['seed']}: highest rate that holds {search['answer']:.4g} req/s")
        held = [p["value"] for p in search["probes"] if p["holds"]]
        assert search["answer"] == max(held) and search["bound"] == min(p["value"] for p in search["probes"]
                                                                          if not p["holds"])
    assert doc["band"]["seeds"] == 2
    before = out.read_text()
    assert _exit(["capacity", "--n", str(N), "--out", str(out)]) == 2 and out.read_text() == before
    assert _exit(["capacity", "--n", str(N), "--force"]) == 2


def test_capacity_cli_bands_its_answer_by_the_searches_at_the_intervals_edge_cost_factors(capsys):
    from servecap.sim.intervals import describe_draw, edge_factors
    assert main(["capacity", "--table", str(T1_REFIT), "--n", str(N), "--max-batch", "16", "--interval", "90",
                 "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    out = out.splitlines()
    edges = edge_factors(load_table(T1_REFIT), 90)[:2]
    assert all(set(d) == {"all"} for d in edges)
    (cheap, dear), (f_cheap, f_dear) = ((describe_draw(d) for d in edges), (d["all"] for d in edges))
    # each probe said on stderr as it is decided, the edges' searches named: as many as the answer line counts
    probes = int(next(line for line in out if line.startswith("seed 0: highest")).split("(")[1].split()[0])
    said = [line for line in err.splitlines() if line.startswith("  seed 0: ")]
    assert len(said) == probes and said[0].endswith((" req/s holds", " req/s fails"))
    assert sum(line.startswith(f"  {dear}, seed 0: ") for line in err.splitlines()) >= 2
    assert next(line for line in out if line.startswith("interval 90%:")).startswith(
        f"interval 90%: each search again with {cheap} and {dear}")
    line = next(line for line in out if "90% interval" in line)
    center = float(line.split("holds ")[1].split()[0])
    low, high = (float(x) for x in line.split("interval ")[1].split(" req/s")[0].split(" .. "))
    # steps that cost F times as much hold about 1/F the rate (retirement's overhead is not scaled)
    assert low < center < high
    assert low == pytest.approx(center / f_dear, rel=0.03) and high == pytest.approx(center / f_cheap, rel=0.03)
    assert _exit(["capacity", "--trace", "x.csv", "--window-s", "100", "--interval", "90"]) == 2
    assert "--interval bands the rate and replica searches, not --window-s" in capsys.readouterr().err


def test_engine_run_saves_its_result_under_vllms_keys(tmp_path, capsys):
    """engine run --save-result writes the real run's figures as sim run does the simulator's (CPU, tiny model),
    and never over a result already there."""
    pytest.importorskip("torch")
    import servecap.engine.cli
    from servecap import engine
    from helpers import run_cli
    trace = tmp_path / "t.csv"
    trace.write_text('# {"meta": {}, "schema": "request-trace", "version": 1}\n'
                     "request_id,arrival_s,prompt_tokens,budget,prompt\n0,0.0,16,4,\n1,0.05,20,4,\n")
    result = tmp_path / "r.json"
    args = ("run", "--device", "cpu", "--model", "tiny", "--trace", str(trace), "--save-result", str(result))
    code, out, err = run_cli(engine.cli.main, capsys, *args, "--slo", "ttft:60000")
    assert code == 0, err
    # What it prints is sim run's: the run in words, its latencies in ms, its SLO line.
    assert "run 1 of 1: 2 requests in " in out and "\n  ms " in out and "\n  TTFT " in out
    assert "SLOs     ttft <= 60000 ms: goodput" in out
    doc = json.loads(result.read_text())
    assert doc["backend"] == "servecap-engine" and doc["completed"] == 2 and doc["total_output_tokens"] == 8
    assert doc["p99_ttft_ms"] >= doc["median_ttft_ms"] > 0 and doc["mean_itl_ms"] > 0
    assert doc["git_commit"] and doc["run"]["device"]["name"] == "cpu"
    code, _, err = run_cli(engine.cli.main, capsys, *args)
    assert code == 2 and "already exists" in err
