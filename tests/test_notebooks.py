"""The notebooks (notebooks/NN_*.py), executed end to end on the CPU as plain scripts, the way CI runs them.

- test_notebook_committed: every notebook on the committed data (the shipped cost table, results/validation/ with
  the cost table its plan names, results/sag/). Where that data is missing the test skips, naming the file.
- test_notebooks_standin: every notebook on stand-in data built in a temp dir: a synthetic cost table with a
  held-out check and a stationarity check, and a validation folder planned by `validate.plan.make_plan` whose
  "real" records are simulator runs with step-time noise.

Figures go to a temp FIGURES_DIR, never into the repository. A torch that refuses to import sits first on the
path: the notebooks must not need it.

    python tests/test_notebooks.py DIR [N]   builds the stand-in in DIR (table.json, validation/ with N requests
                                             per arrival point) for trying the notebooks by hand, with
                                             SERVECAP_TABLE=DIR/table.json SERVECAP_VALIDATION=DIR/validation
                                             SERVECAP_SAG=DIR/sag SERVECAP_REQUESTS=N
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TABLE = ROOT / "servecap" / "costs" / "data" / "h200.json"
VALIDATION = ROOT / "results" / "validation"
SAG = ROOT / "results" / "sag"
MISSING_DATA = 3  # notebooks/_style.py: the exit status of a notebook whose data is not there
ENV = ("SERVECAP_TABLE", "SERVECAP_VALIDATION", "SERVECAP_SAG", "SERVECAP_REQUESTS", "FIGURES_DIR")
STANDIN_N = 80  # requests per stand-in trace: enough to saturate 32 rows, few enough for CI

# Each notebook and the figures it must write.
FIGURES = {
    "01_capacity": ["01_served_rate", "01_queue_wait", "01_capacity_summary", "01_prefill_policies"],
    "02_sim_vs_real": ["02_targets", "02_served_rate_curve", "02_queue_wait_curve", "02_predicted_vs_measured",
                       "02_errors", "02_spread"],
    "03_where_time_goes": ["03_time_split", "03_sag", "03_groups", "03_disturbance_timeline", "03_spikes"],
    "04_memory": ["04_pool_capacity", "04_memory_bound"],
    "05_cost_table": ["05_prefill", "05_decode", "05_accuracy", "05_stationarity"],
    "06_replicas": ["06_replicas_needed", "06_tail_ttft"],
}
# The committed data each needs (the validation's own cost table is found through its plan).
NEEDS = {"01_capacity": [TABLE], "02_sim_vs_real": [VALIDATION / "plan.json", VALIDATION / "real"],
         "03_where_time_goes": [VALIDATION / "plan.json", VALIDATION / "real", SAG / "search.json"],
         "04_memory": [TABLE], "05_cost_table": [TABLE], "06_replicas": [TABLE]}
TIMEOUT_S = 300


# ---- the stand-in data ------------------------------------------------------------------------------------
def _wiggle(a, b):  # a few percent a fitted model cannot follow, as in measured costs
    return 1 + 0.02 * np.sin(np.log2(np.asarray(a, float)) * 2.3 + np.log2(np.asarray(b, float)))


def _prefill_s(shape) -> float:  # H200-like: a launch floor, then linear work plus attention's square
    return (0.004 + 5.7e-6 * shape.tokens + 1.2e-9 * shape.attn) * float(_wiggle(shape.rows, shape.tokens))


def _decode_s(backend: str, rows: int, kv_tokens, kv_max):  # the K/V read, and the longest row's walk
    from servecap.costs.shapes import kv_read

    kv_tokens, kv_max = np.asarray(kv_tokens, float), np.asarray(kv_max, float)
    return (0.0019 + 1.5e-5 * rows + 3.0e-9 * kv_read(backend, rows, kv_tokens, kv_max) + 2e-8 * kv_max) * \
        _wiggle(rows, kv_tokens)


def _measured(runs: list, rng: np.random.Generator) -> dict:
    """Made-up measurements of calibration runs, in servecap/calibrate/measure.py's format: the cost functions with
    a few percent of noise."""
    from servecap.calibrate.points import step_shapes

    samples = {}
    for run in runs:
        if run.kind.endswith("prefill"):
            shapes = step_shapes(run)
            samples[run.key] = {"prefill": [[[s.rows, s.tokens, s.attn, _prefill_s(s) * rng.lognormal(0, 0.03)]
                                             for s in shapes] for _ in range(run.reps)]}
            continue
        steps = np.arange(1, run.budget)  # each row also reads the token it writes
        kv_tokens, kv_max = sum(run.prompts) + run.width * steps, max(run.prompts) + steps
        dur = _decode_s(run.backend, run.width, kv_tokens, kv_max) * rng.lognormal(0, 0.03, steps.size)
        end = np.cumsum(dur)
        samples[run.key] = {"kv_tokens": kv_tokens.tolist(), "kv_max": kv_max.tolist(),
                            "start": (end - dur).tolist(), "end": end.tolist(), "first": dur.tolist(),
                            "again": (dur * rng.lognormal(0, 0.03, steps.size)).tolist()}
    return samples


def standin_table(seed: int = 7) -> dict:
    """A synthetic cost table with the two checks a calibration adds: held-out shapes (servecap/calibrate/accuracy.py)
    and never-run shapes first against repeats (servecap/calibrate/table.py), on made-up measurements."""
    from servecap.calibrate.accuracy import check
    from servecap.calibrate.plan import FULL, check_runs, stationarity_runs
    from servecap.calibrate.table import stationarity
    from servecap.costs.model import CostModel
    from servecap.costs.synthetic import synthetic_table

    table = synthetic_table(_prefill_s, lambda b, r, t, m: float(_decode_s(b, r, t, m)), retire_s=1e-4, sigma=0.05,
                            name="stand-in (synthetic)")
    rng = np.random.default_rng(seed)
    backends = tuple(table["decode"])
    held_out = check_runs(FULL, table["max_batch"], backends)
    never_run = stationarity_runs(FULL, table["max_batch"], backends)
    table["accuracy"] = check(CostModel(table), held_out, _measured(held_out, rng))
    table["stationarity"] = stationarity(never_run, _measured(never_run, rng))
    return table


def _sag_candidates(n: int) -> list[dict]:
    """Two configurations past capacity, in the form servecap/validate/sag.py writes candidates.json."""
    trace = {"kind": "synthetic", "n": n, "seed": 0, "prompts": "five", "budgets": "fixed:32"}
    return [{"name": "five-fixed32-b16-pool-1gib-padded", "max_batch": 16, "pool_gib": 1.0, "prefill": "padded",
             "trace": trace, "rates": [40.0, 80.0, 160.0]},
            {"name": "five-fixed32-b32-pool-ample-padded", "max_batch": 32, "pool_gib": None, "prefill": "padded",
             "trace": trace, "rates": [40.0, 80.0, 160.0]}]


def _write_run(rec, out: Path, meta: dict) -> None:
    from datetime import datetime, timezone

    from servecap.traces.records import RunWriter

    # stamped as the engine stamps its records: made now, after the plan (validate report refuses earlier ones)
    w = RunWriter(out, {**rec.meta, "created_at": datetime.now(timezone.utc).isoformat(), **meta})
    for t in ("requests", "steps", "tokens", "rejected"):
        w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    w.close()


def build_standin(out: Path, n: int = STANDIN_N) -> tuple[Path, Path, Path]:
    """out/table.json (standin_table), out/validation (the plan `validate.plan.make_plan` makes from it, public
    traces and blind policy predictions left out, sag candidates in; every point and repeat "run" by the
    simulator with step-time noise) and out/sag (the candidates, no search)."""
    from servecap.costs.model import CostModel
    from servecap.costs.table import load_cost_table, save_cost_table
    from servecap.sim import SimConfig, simulate
    from servecap.sim.fleet import simulate_fleet
    from servecap.validate.plan import make_plan
    from servecap.validate.points import build_trace, load_plan, run_dir

    out.mkdir(parents=True, exist_ok=True)
    save_cost_table(standin_table(), out / "table.json")
    (out / "sag").mkdir(exist_ok=True)
    (out / "sag" / "candidates.json").write_text(json.dumps(_sag_candidates(n), indent=1))
    vdir = out / "validation"
    make_plan(out / "table.json", vdir, n=n, skip=("public", "policies"), sag=out / "sag" / "candidates.json")
    plan, points = load_plan(vdir)
    cost = CostModel(load_cost_table(out / "table.json"))
    for p in points:
        trace = build_trace(p.trace, vdir)
        for k in range(1, p.repeats + 1):
            cfg = SimConfig(p.serving, detail="tokens" if p.tokens else "steps", noise_seed=k)
            rec = (simulate_fleet(trace, cost, cfg) if p.serving.replicas > 1 else
                   simulate(trace, cost, cfg)).record
            _write_run(rec, run_dir(vdir, p, k), {"kind": "engine", "device": {"name": "stand-in (simulated runs)"},
                                                  "validation_point": p.id, "repeat": k,
                                                  "plan_table_id": plan["table"]["id"]})
    return out / "table.json", vdir, out / "sag"


# ---- running a notebook -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text('raise ImportError("the notebooks must not import torch")\n')
    return d


def run_notebook(name: str, figures: Path, no_torch: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ENV}
    clean.update(MPLBACKEND="Agg", FIGURES_DIR=str(figures), PYTHONPATH=os.pathsep.join([str(no_torch), str(ROOT)]),
                 **env)
    return subprocess.run([sys.executable, str(NOTEBOOKS / f"{name}.py")], cwd=figures, env=clean,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def check_ran(name: str, proc: subprocess.CompletedProcess, figures: Path) -> None:
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                 f"--- stderr\n{proc.stderr[-5000:]}"
    written = sorted(p.stem for p in figures.glob("*.png"))
    assert written == sorted(FIGURES[name]), f"{name} wrote {written}, expected {sorted(FIGURES[name])}"
    for fig in FIGURES[name]:
        data = (figures / f"{fig}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{fig}.png is not a PNG"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 300 and len(data) > 20_000, \
            f"{fig}.png looks empty ({width}x{height}, {len(data)} bytes)"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIGURES))
def test_notebook_committed(name, tmp_path, no_torch):
    absent = [p for p in NEEDS[name] if not p.exists() or (p.name == "real" and not any(p.glob("*/run-*/meta.json")))]
    if absent:
        pytest.skip(f"{name}: committed data not there: {', '.join(str(p.relative_to(ROOT)) for p in absent)}")
    proc = run_notebook(name, tmp_path, no_torch)
    assert proc.returncode != MISSING_DATA, f"{name} says data is missing although it is committed:\n{proc.stderr}"
    check_ran(name, proc, tmp_path)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> tuple[Path, Path, Path]:
    return build_standin(tmp_path_factory.mktemp("standin"))


@pytest.mark.slow
def test_notebooks_standin(standin, tmp_path, no_torch, progress):
    """Every notebook on the stand-in data, two at a time."""
    table, vdir, sag = standin

    def one(name: str):
        figures = tmp_path / name
        figures.mkdir()
        t = time.perf_counter()
        proc = run_notebook(name, figures, no_torch, SERVECAP_TABLE=str(table), SERVECAP_VALIDATION=str(vdir),
                            SERVECAP_SAG=str(sag), SERVECAP_REQUESTS=str(STANDIN_N))
        return name, figures, proc, time.perf_counter() - t

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(one, name) for name in FIGURES]
        for run in as_completed(runs):  # a line as each ends, from this thread (the terminal's writer)
            name, _, proc, wall = run.result()
            progress(f"{name} exited {proc.returncode} after {wall:.0f} s")
    for name, figures, proc, _ in (run.result() for run in runs):
        check_ran(name, proc, figures)


def test_missing_data_is_one_clear_line(tmp_path, no_torch):
    """No table, or no validation: the notebook stops with the missing file and the command that makes it, not a
    traceback."""
    absent = tmp_path / "nowhere" / "h200.json"
    proc = run_notebook("05_cost_table", tmp_path, no_torch, SERVECAP_TABLE=str(absent))
    assert proc.returncode == MISSING_DATA, proc.stderr
    assert str(absent) in proc.stderr and "python -m calibrate" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = run_notebook("02_sim_vs_real", tmp_path, no_torch, SERVECAP_VALIDATION=str(tmp_path / "novalidation"))
    assert proc.returncode == MISSING_DATA, proc.stderr
    assert str(tmp_path / "novalidation" / "plan.json") in proc.stderr and "python -m validate plan" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_notebooks_are_percent_scripts():
    """Each notebook converts with jupytext into markdown and code cells."""
    jupytext = pytest.importorskip("jupytext")
    for name in FIGURES:
        nb = jupytext.read(NOTEBOOKS / f"{name}.py")
        kinds = [c.cell_type for c in nb.cells]
        assert kinds.count("markdown") >= 3 and kinds.count("code") >= 3, f"{name}: cells {kinds}"
        assert nb.cells[0].cell_type == "markdown", f"{name} should open with a markdown cell"


if __name__ == "__main__":
    n = int(sys.argv[2]) if len(sys.argv) > 2 else STANDIN_N
    table, vdir, sag = build_standin(Path(sys.argv[1]), n)
    print(f"SERVECAP_TABLE={table} SERVECAP_VALIDATION={vdir} SERVECAP_SAG={sag} SERVECAP_REQUESTS={n}")
