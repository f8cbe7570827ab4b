"""The simulator: hand-computed runs, the engine's own loop as the reference, fast-forward, noise, the CLI.

Hand-computed cases use constant costs (prefill 0.1 s, decode step 0.01 s, no retire overhead unless said),
so every time is a sum written out in a comment.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import constant_table, linear_table, run_cli, serve_virtual, sim_config, write_table

import servecap.sim.inputs

from servecap import sim
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.costs.model import CostModel
from servecap.costs.shapes import BACKENDS
from servecap.sim import simulate
from servecap.traces.metrics import occupancy
from servecap.sim.cli import main
from servecap.sim.report import mechanism, ranking
from servecap.sim.sweep import ConfigResult, auto_rates
from servecap.traces import metrics
from servecap.traces.errors import InputError
from servecap.traces.model_spec import QWEN25_1P5B
from servecap.traces.records import read_run
from servecap.traces.cli import main as traces_main
from servecap.traces.trace_io import write_trace
from servecap.traces.workload import Trace, closed_uniform, length_trace, poisson_trace

REPO = Path(__file__).resolve().parents[1]
near = pytest.approx  # sums of decimal step costs agree to ~1e-15, not bit for bit


def run(requests, table=None, detail="tokens", **cfg):
    """Simulate (arrival, prompt tokens, budget) triples; the requests frame indexed by request id."""
    result = simulate(length_trace(requests), CostModel(table or constant_table()), sim_config(detail=detail, **cfg))
    return result.record.requests.set_index("request_id").sort_index(), result


def test_two_requests_by_hand():
    # r0 arrives at 0 (16 tokens, budget 3), r1 at 0.05 (16, budget 2).
    # t=0: r0 admitted; prefill 0 -> 0.1 (first token); decode 0.1 -> 0.11 (token 2).
    # t=0.11: r1 (arrived 0.05) admitted; prefill 0.11 -> 0.21 (r1's first token);
    # decode r0 and r1 0.21 -> 0.22: r0's third token and r1's second, so both finish at 0.22.
    req, _ = run([(0.0, 16, 3), (0.05, 16, 2)])
    assert list(req["admitted"]) == near([0.0, 0.11])
    assert list(req["first_token"]) == near([0.1, 0.21])
    assert list(req["finished"]) == near([0.22, 0.22])
    assert list(req["group_id"]) == [0, 1] and list(req["admit_step"]) == [0, 1]


def test_retire_overhead_delays_the_next_step_not_the_finish():
    # retire_s 0.005. r0 (budget 2): prefill 0 -> 0.1, decode 0.1 -> 0.11, finishes at 0.11 and retires, so that
    # decode step ends at 0.115 and r1 (arrived 0.05) is admitted at 0.115: prefill -> 0.215, decode -> 0.225,
    # finished 0.225, its step ending at 0.23.
    req, result = run([(0.0, 16, 2), (0.05, 16, 2)], constant_table(retire_s=0.005))
    assert list(req["finished"]) == near([0.11, 0.225])
    assert req.loc[1, "admitted"] == near(0.115)
    decode = result.record.steps.query("kind == 'decode'")
    assert list(decode["end"]) == near([0.115, 0.23])


def test_head_of_line_blocking_by_the_pool():
    # A 2-block pool and 2 rows. r0 (64 + 64 tokens = 2 blocks) takes every block; r1 (16 + 4 tokens, 1 block)
    # arrives at 0.05 and waits with a row free. r0: prefill 0 -> 0.1, then 63 decode steps: finishes at
    # 0.1 + 63 x 0.01 = 0.73. r1 is admitted at 0.73 (step 63): prefill -> 0.83, 3 decode steps -> 0.86.
    req, result = run([(0.0, 64, 64), (0.05, 16, 4)], max_batch=2, pool_blocks=2)
    assert list(req["admitted"]) == near([0.0, 0.73])
    assert list(req["first_token"]) == near([0.1, 0.83])
    assert list(req["finished"]) == near([0.73, 0.86])
    assert req.loc[1, "admit_step"] == 63
    # One row runs all the time: mean 1.0, also while r1 waited. The head waited for blocks with a row free
    # from its arrival at 0.05 to 0.73, of the 0.86 s rows were running.
    occ = occupancy(result.record)
    assert occ["mean_running_rows"] == near(1.0) and occ["rows_while_queued"] == near(1.0)
    assert occ["head_blocked_frac"] == near(0.68 / 0.86)


def test_arrivals_during_a_step_form_one_padded_group():
    # Prefill costs 0.1 s per 256 x 1 padded positions (the fit's linear term alone, exactly); decode 0.01 s.
    table = constant_table(decode_s=0.01)
    table["fit"]["prefill"].update(floor_s=0.0, per_token_s=0.1 / 256)
    # r0 (16 tokens, budget 2): prefill 0 -> 0.00625, decode -> 0.01625, done. r1 (256 tokens) and r2 (16)
    # arrive during it and are admitted together at 0.01625, padded to 256: prefill(2, 256) = 0.2 s ->
    # 0.21625, decode -> 0.22625.
    req, result = run([(0.0, 16, 2), (0.002, 256, 2), (0.004, 16, 2)], table)
    assert list(req["group_id"]) == [0, 1, 1] and list(req["group_size"]) == [1, 2, 2]
    assert list(req["admitted"]) == near([0.0, 0.01625, 0.01625])
    assert list(req["first_token"]) == near([0.00625, 0.21625, 0.21625])
    assert list(req["finished"]) == near([0.01625, 0.22625, 0.22625])
    groups = metrics.admission_groups(result.record)["groups"]
    assert list(groups["padded_len"]) == [16, 256] and list(groups["prompt_tokens"]) == [16, 272]
    assert groups["waste"].iloc[1] == near((2 * 256 - 272) / 272)


def test_a_group_never_takes_more_rows_than_the_batch_has():
    trace = closed_uniform("p16", 40, budget=4)
    result = simulate(trace, CostModel(constant_table()), sim_config(max_batch=32))
    sizes = result.record.requests.groupby("group_id").size()
    assert sizes.iloc[0] == 32 and sizes.max() == 32


def test_a_request_too_large_for_the_pool_is_rejected_and_the_run_goes_on():
    # 3-block pool: r1 needs 256 + 64 = 320 tokens = 5 blocks and is refused on arrival. r0 (16, budget 16):
    # prefill 0 -> 0.1, then a decode step every 0.01 s. r1 arrives at 0.15 and changes nothing; r2 arrives at
    # 0.165 and is admitted at the next step end, 0.1 + 7 x 0.01 = 0.17 (r0 then has 8 tokens): prefill -> 0.27,
    # decode r0, r2 -> 0.28, r2 done. r0 has 16 - 9 = 7 tokens left: 0.28 + 7 x 0.01 = 0.35.
    triples = [(0.0, 16, 16), (0.15, 256, 64), (0.165, 16, 2)]
    req, result = run(triples, max_batch=2, pool_blocks=3)
    assert list(req.index) == [0, 2]
    assert req.loc[2, "admitted"] == near(0.17)
    assert list(req["finished"]) == near([0.35, 0.28])
    rejected = result.record.rejected
    assert list(rejected["request_id"]) == [1] and "needs 5 blocks" in rejected["reason"].iloc[0]
    # Up-front validation (what the CLI does) refuses the trace instead, naming the request.
    with pytest.raises(InputError, match=r"request 1 needs 5 blocks of 64 tokens .* pool has 3"):
        sim.inputs.check_trace(length_trace(triples), constant_table(), ServingConfig(max_batch=2), 3)


def test_a_trace_past_the_models_positions_is_refused_with_how_many_and_the_fix():
    # Two of three requests pass 32768 positions (one by its prompt, one by prompt + budget); the pool is no limit.
    triples = [(0.0, 16, 16), (0.1, 40000, 6), (0.2, 32760, 9)]
    with pytest.raises(InputError, match=r"^2 of 3 requests are beyond the model's 32768 positions .*request 1: "
                                         r"40000 \+ 6\).*--max-prompt.*--max-budget"):
        sim.inputs.check_trace(length_trace(triples), constant_table(), ServingConfig(max_batch=2), 10 ** 6)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns[:2])).reset_index(drop=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_simulator_replays_the_engine_loop(backend):
    """engine.serve.serve on a virtual clock with the same step costs is the reference: same admissions,
    groups, token times and steps, so the two loops cannot drift apart."""
    cost = CostModel(linear_table())  # costs depend on the shapes, and retiring costs 2 ms
    trace = poisson_trace(3.0, 100, 1)
    engine = serve_virtual(trace, cost, backend, max_batch=8, pool_blocks=150)
    result = simulate(trace, cost, sim_config(backend=backend, max_batch=8, pool_blocks=150, detail="tokens"))
    for table in ("requests", "steps", "tokens"):
        a, b = _sorted(getattr(engine, table)), _sorted(getattr(result.record, table))
        assert len(a) == len(b)
        num = a.select_dtypes("number").columns
        pd.testing.assert_frame_equal(a[num], b[num], check_exact=False, rtol=0, atol=1e-9)
        assert (a.select_dtypes(exclude="number") == b.select_dtypes(exclude="number")).all().all()
    # The case exercises what it should: multi-request groups and a head waiting for blocks.
    assert engine.requests["group_size"].max() > 1 and occupancy(result.record)["head_blocked_frac"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("noise_seed", [None, 3])
def test_fast_forward_gives_the_same_record_as_stepping(backend, noise_seed):
    cost = CostModel(linear_table(sigma=0.1))
    trace = poisson_trace(2.0, 120, 5)
    runs = [simulate(trace, cost, sim_config(backend=backend, max_batch=16, pool_blocks=300, detail="tokens", fast_forward=ff,
                                               noise_seed=noise_seed))
            for ff in (True, False)]
    for table in ("requests", "steps", "tokens", "rejected"):
        pd.testing.assert_frame_equal(getattr(runs[0].record, table), getattr(runs[1].record, table), check_exact=True)
    assert runs[0].steps == runs[1].steps
    assert runs[0].passes < runs[1].passes / 5  # fast-forward really did skip most event-loop passes


def test_deterministic_by_default_and_noise_is_seeded():
    cost = CostModel(linear_table(sigma=0.1))
    trace = poisson_trace(2.0, 80, 0)

    def finished(**cfg):
        return simulate(trace, cost, sim_config(**cfg)).record.requests["finished"].tolist()

    assert finished() == finished()
    assert finished(noise_seed=1) == finished(noise_seed=1)
    assert finished(noise_seed=1) != finished(noise_seed=2)
    assert finished(noise_seed=1) != finished()


def test_runs_without_torch(tmp_path):
    table = write_table(constant_table(), tmp_path / "t.json")
    code = f"""
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ("torch", "triton", "transformers"):
            raise ImportError(name + " is blocked")

# A finder, not sys.modules['torch'] = None: scipy looks torch up in sys.modules and trips over a None there.
sys.meta_path.insert(0, NoTorch())
import servecap.sim.bench, servecap.sim.cli
assert servecap.sim.cli.main(["run", "--rate", "2", "--n", "20", "--table", {str(table)!r}]) == 0
assert not [m for m in sys.modules if m.partition(".")[0] in ("torch", "triton", "transformers")]
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "served" in done.stdout


# --- CLI -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tables")
    return {"linear": write_table(linear_table(), d / "linear.json"),
            "other_model": write_table(linear_table(model={**QWEN25_1P5B, "name": "Other-2B", "num_hidden_layers": 30}),
                                       d / "other.json"),
            "blocks_32": write_table(linear_table(block_size=32), d / "b32.json")}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    return run_cli(main, capsys, *argv)


def test_cli_run_writes_the_run_record(capsys, tables, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = cli(capsys, "run", "--rate", "2", "--n", "60", "--pool-gib", "0.5", "--table",
                          str(tables["linear"]), "--out", str(out), "--tokens")
    assert code == 0 and "\n  queue wait " in stdout and "292 blocks (0.5 GiB)" in stdout
    rec = read_run(out)
    assert rec.meta["status"] == "complete" and rec.meta["kind"] == "sim" and rec.meta["pool_blocks"] == 292
    assert len(rec.requests) == 60 and set(rec.steps["kind"]) == {"prefill", "decode"}
    assert len(rec.tokens) == rec.requests["output_tokens"].sum()
    assert rec.meta["summary"]["served_rate"] == pytest.approx(metrics.served_rate(rec))


def test_cli_sweep_writes_tables_and_plot(capsys, tables, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, _ = cli(capsys, "sweep", "--rates", "1,6", "--pool-gib", "0.5,2", "--max-batch", "8",
                          "--backend", "paged", "--n", "40", "--jobs", "2", "--table", str(tables["linear"]),
                          "--out", str(out))
    assert code == 0
    assert "paged, max batch 8, pool 0.5 GiB (292 blocks): capacity between 1 and 6 req/s" in stdout
    assert "wait p50" in stdout and "bound" in stdout
    points = pd.read_csv(out / "sweep.csv")
    assert len(points) == 4 and set(points["rate"]) == {1.0, 6.0}
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["table"]["id"] == json.loads(tables["linear"].read_text())["table_id"]
    assert [c["capacity_hi"] for c in doc["configurations"]] == [6.0, 6.0] and doc["trace_ids"]
    assert (out / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize("backends", [("paged",), ("dense",), ("dense", "paged")])
def test_cli_sweep_without_backend_sweeps_every_backend_the_table_prices_paged_first(capsys, tmp_path, backends):
    table = write_table(linear_table(backends=backends), tmp_path / "t.json")
    assert list(json.loads(table.read_text())["decode"]) == list(backends)  # the file's order
    out = tmp_path / "sweep"
    code, _, _ = cli(capsys, "sweep", "--rates", "2", "--pool-gib", "1", "--max-batch", "8", "--n", "20", "--jobs",
                     "1", "--table", str(table), "--out", str(out))
    assert code == 0
    assert list(pd.read_csv(out / "sweep.csv")["backend"]) == [b for b in ("paged", "dense") if b in backends]


def test_sweep_plot_draws_queue_wait_in_ms_and_each_interval_as_a_bar(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from servecap.sim.sweep_plot import plot
    res = ConfigResult(ServingConfig(backend="paged"), 100, [5.0, 10.0], None, seed=0,
                       bands=[{"served_rate": {"lo": 4.5, "hi": 5.2, "median": 4.9},
                               "queue_wait_p50": {"lo": 0.001, "hi": 0.003, "median": 0.002}},
                              {"served_rate": {"lo": 8.0, "hi": 9.5, "median": 9.0},
                               "queue_wait_p50": {"lo": 0.02, "hi": 0.05, "median": 0.03}}])
    rows = [{"rate": r, "served_rate_mean": m, "queue_wait_p50_mean": w} for r, m, w in ((5.0, 4.9, 0.002),
                                                                                         (10.0, 9.0, 0.03))]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot([([res], rows)], tmp_path / "sweep.png", "subtitle", 90)
    served, wait = figures[0].axes
    assert wait.get_ylabel() == "queue wait p50 (ms)" and list(wait.lines[0].get_ydata()) == [2.0, 30.0]
    bars = [c for c in wait.collections if len(c.get_segments())][0].get_segments()
    assert [(seg[0][1], seg[1][1]) for seg in bars] == [(1.0, 3.0), (20.0, 50.0)]  # ms, each rate's band
    assert any("90% interval" in t.get_text() for t in figures[0].legends[0].get_texts())


@pytest.mark.parametrize("args, message", [
    (["run", "--rate", "-1"], "is not a positive number of requests per second"),
    (["run", "--rate", "1", "--pool-blocks", "10"], "the pool is smaller than the largest request: request"),
    (["run", "--rate", "1", "@other_model"], "was measured on model Other-2B"),
    (["run", "--rate", "1", "@blocks_32"], "measured with 32-token blocks, not 64"),
    (["run", "--closed-mixed", "40", "--max-batch", "40", "--strict"], "outside the cost table's measured range"),
    (["sweep", "--pool-gib", "0.01"], "pool 0.01 GiB (5 blocks): the pool is smaller than the largest request"),
])
def test_cli_refuses_bad_input_and_writes_nothing(capsys, tables, tmp_path, args, message):
    table = next((tables[a[1:]] for a in args if a.startswith("@")), tables["linear"])
    args = [a for a in args if not a.startswith("@")]
    out = tmp_path / "out"
    code, _, err = cli(capsys, *args, "--table", str(table), "--out", str(out))
    assert code == 2 and message in err
    assert not out.exists()


def test_cli_refuses_a_trace_made_for_another_model(capsys, tables, tmp_path):
    trace = poisson_trace(1.0, 10, 0)
    path = write_trace(Trace(trace.requests, {**trace.meta, "model": "Other-2B"}), tmp_path / "t.csv")
    code, _, err = cli(capsys, "run", "--trace", str(path), "--table", str(tables["linear"]),
                       "--out", str(tmp_path / "o"))
    assert code == 2 and "the trace was made for model Other-2B, not Qwen2.5-1.5B" in err
    assert not (tmp_path / "o").exists()


def test_cli_run_says_what_the_traces_import_dropped_and_clipped(capsys, tables, tmp_path):
    src, path = tmp_path / "src.csv", tmp_path / "t.csv"
    rows = (f"{i},{9000 if i == 3 else 100 + i},{300 if i % 2 else 50}\n" for i in range(12))
    src.write_text("t,p,o\n" + "".join(rows))
    assert traces_main(["import", str(src), "--timestamp", "t", "--input", "p", "--output", "o", "--max-prompt", "4096",
                        "--max-budget", "256", "--out", str(path)]) == 0
    line = "1 of 12 prompts over 4096 tokens dropped, 5 of 11 outputs clipped to 256 tokens"
    out, result = tmp_path / "run", tmp_path / "r.json"
    code, stdout, _ = cli(capsys, "run", "--trace", str(path), "--table", str(tables["linear"]), "--out", str(out),
                          "--save-result", str(result))
    assert code == 0 and f"\nimport   {line}\n" in stdout
    assert read_run(out).meta["import"] == line and json.loads(result.read_text())["import"] == line
    code, stdout, _ = cli(capsys, "sweep", "--trace", str(path), "--rates", "1", "--pool-gib", "1", "--max-batch", "8",
                          "--backend", "paged", "--jobs", "1", "--table", str(tables["linear"]),
                          "--out", str(tmp_path / "s"))
    assert code == 0 and f"(11 requests; import: {line})" in stdout
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["import"] == line
    code, stdout, _ = cli(capsys, "run", "--rate", "2", "--n", "10", "--table", str(tables["linear"]))
    assert code == 0 and "\nimport " not in stdout  # a seeded trace was not imported


def test_cli_without_the_shipped_table_says_how_to_pass_one(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sim.inputs, "SHIPPED_TABLE", tmp_path / "h200.json")
    code, _, err = cli(capsys, "--out", str(tmp_path / "out"))  # no command: the default sweep
    assert code == 2 and "shipped H200 cost table" in err and "--table" in err
    assert not (tmp_path / "out").exists()


# --- explaining a sweep -------------------------------------------------------------------------------------

def _point(rate, served, stable, group_p95=1, waste_p95=0.0, blocked=0.0, rows=16.0):
    return {"rate": rate, "served_rate": served, "stable": stable, "queue_wait_p50": 0.0 if stable else 10.0 * rate,
            "group_size_p95": group_p95, "group_size_max": 2 * group_p95, "padding_waste_p95": waste_p95,
            "head_blocked_frac": blocked, "rows_while_queued": rows}


def test_mechanism_names_the_sag_and_the_memory_bound():
    sag = ConfigResult(ServingConfig(max_batch=32, pool=PoolSize(gib=0.5)), 292, [1, 3, 5, 7], None,
                       [_point(1, 1.0, True), _point(3, 2.9, False, 2, 0.1, 0.4, 14.0),
                        _point(5, 3.9, False, 4, 0.8, 0.4, 14.0), _point(7, 2.9, False, 6, 2.8, 0.5, 13.5)])
    lines = mechanism(sag)
    assert lines[0].startswith("past capacity the served rate sags from 3.90 req/s (at rate 5) to 2.90 (at rate 7)")
    assert "p95 2 -> 6 (max 12)" in lines[0] and "0.10 -> 2.80" in lines[0]
    assert lines[1].startswith("memory-bound: at 7 req/s only 13.5 of 32 rows run") and "50% of step time" in lines[1]
    flat = ConfigResult(ServingConfig(max_batch=16, pool=PoolSize(gib=4)), 2340, [1, 3], None, [_point(1, 1.0, True), _point(3, 2.2, False)])
    lines = mechanism(flat)
    assert lines[0].startswith("past capacity the served rate holds near 2.20") and lines[1].startswith("compute-bound")


def test_ranking_puts_the_highest_capacity_first_and_names_a_pool_that_never_binds():
    def config(batch, gib, points):
        return ConfigResult(ServingConfig(max_batch=batch, pool=PoolSize(gib=gib)), 100, [p["rate"] for p in points],
                            None, points)
    holds_3 = [_point(1, 1.0, True), _point(3, 2.9, True), _point(5, 3.5, False)]
    results = [config(16, 1, [_point(1, 0.9, False), _point(3, 1.0, False)]),  # fails at every tested rate
               config(32, 2, holds_3), config(32, 4, [dict(p) for p in holds_3]),
               config(16, 2, [_point(1, 1.0, True), _point(3, 2.9, True)])]  # holds at every tested rate
    head, *lines, foot = ranking(results)
    assert head.startswith("capacity by configuration, highest first (by stability:") and "overlap" in foot
    assert [line.split()[:2] for line in lines] == [["above", "3"], ["3-5", "req/s"], ["3-5", "req/s"],
                                                   ["below", "1"]]
    assert lines[0].endswith("paged, max batch 16, pool 2 GiB") and lines[3].endswith("pool 1 GiB")
    assert lines[1].endswith("max batch 32, pool 2 GiB")
    assert lines[2].endswith("max batch 32, pool 4 GiB  (the same at every point as pool 2 GiB: the pool does not bind)")
    # With SLOs the bracket is the SLOs' (slo_ok), not stability's.
    for p in results[1].rows:
        p["slo_ok"] = p["rate"] < 2
    assert ranking(results[1:2], ("an SLO",))[1].split()[0] == "1-3"


def test_auto_rates_span_the_estimate():
    rates = auto_rates(2.0)
    assert len(rates) == 12 and rates[0] == 0.6 and rates[-1] == 4.0 and rates == sorted(rates)


def test_a_trace_file_is_scaled_to_the_rate_asked_for(tmp_path):
    path = write_trace(poisson_trace(1.0, 50, 2), tmp_path / "t.csv")
    trace = sim.inputs.make_trace(rate=4.0, trace_file=path)
    assert trace.offered_rate == pytest.approx(4.0, rel=1e-4) and trace.meta["rate"] == 4.0
    assert [r.prompt_tokens for r in trace.requests] == [r.prompt_tokens for r in poisson_trace(1.0, 50, 2).requests]
