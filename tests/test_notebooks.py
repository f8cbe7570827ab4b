"""The notebooks (notebooks/NN_*.py), executed end to end on the CPU as plain scripts, the way CI runs them.

- test_notebook_committed: every notebook on the committed data (the shipped cost table, results/validation/).
  While that data is not committed yet the test skips, naming the missing file; once it is, it must run.
- test_notebook_standin: every notebook on stand-in data built in a temp dir (a synthetic cost table with an
  accuracy section, and a small validation folder of simulator-made "real" records), so the notebooks run in
  CI before the real data lands.

Figures go to a temp FIGURES_DIR, never into the repository. A torch that refuses to import sits first on the
path: the notebooks must not need it.

    python tests/test_notebooks.py DIR [N]   builds the stand-in in DIR (table.json, validation/ with N requests
                                             per arrival point) for trying the notebooks by hand, with
                                             SERVECAP_TABLE=DIR/table.json SERVECAP_VALIDATION=DIR/validation
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TABLE = ROOT / "sim" / "data" / "h200.json"
VALIDATION = ROOT / "results" / "validation"
MISSING_DATA = 3  # notebooks/_style.py: the exit status of a notebook whose data is not there

# Each notebook, the committed data it needs, and the figures it must write.
FIGURES = {
    "01_capacity": ["01_served_rate", "01_queue_wait", "01_capacity_summary"],
    "02_sim_vs_real": ["02_served_rate_curve", "02_predicted_vs_measured", "02_errors"],
    "03_where_time_goes": ["03_sag_mechanism", "03_groups", "03_disturbance_timeline", "03_spikes"],
    "04_memory": ["04_pool_capacity", "04_memory_bound"],
    "05_cost_table": ["05_prefill", "05_decode", "05_accuracy"],
}
NEEDS = {"01_capacity": [TABLE], "02_sim_vs_real": [TABLE, VALIDATION / "plan.json", VALIDATION / "real"],
         "03_where_time_goes": [TABLE, VALIDATION / "plan.json", VALIDATION / "real"], "04_memory": [TABLE],
         "05_cost_table": [TABLE]}
TIMEOUT_S = 300


# ---- the stand-in data ------------------------------------------------------------------------------------
def _wiggle(*shape) -> float:  # a few percent a fitted model cannot follow, as in measured costs
    return 1 + 0.02 * np.sin(np.log2(np.asarray(shape[0], float)) * 2.3 + np.log2(np.asarray(shape[-1], float)))


def _prefill_s(width: int, padded_len: int) -> float:  # H200-like: launch floor, linear, then attention's square
    return (0.004 + 5.7e-6 * width * padded_len + 1.2e-9 * width * padded_len**2) * _wiggle(width, padded_len)


def _decode_s(backend: str, rows: int, kv_tokens, kv_max):  # the K/V read, and the longest row's walk
    from engine.recorder import kv_read

    kv_tokens, kv_max = np.asarray(kv_tokens, float), np.asarray(kv_max, float)
    return (0.0019 + 1.5e-5 * rows + 3.0e-9 * kv_read(backend, rows, kv_tokens, kv_max) + 2e-8 * kv_max) * \
        _wiggle(rows, kv_tokens)


def _accuracy(table: dict, seed: int = 7) -> dict:
    """The held-out check a calibration writes (calibrate/accuracy.py), on made-up "measurements" of the
    cost functions at the real plan's held-out shapes."""
    from calibrate.accuracy import check
    from calibrate.cost_model import CostModel
    from calibrate.sweep import FULL, check_runs

    rng = np.random.default_rng(seed)
    runs = check_runs(FULL, table["max_batch"], tuple(table["decode"]))
    samples = {}
    for run in runs:
        if run.kind == "check-prefill":
            samples[run.key] = {"prefill_s": list(_prefill_s(run.width, run.padded_len) *
                                                  rng.lognormal(0, 0.03, run.reps))}
            continue
        steps = np.arange(1, run.budget)  # each row also reads the token it writes
        kv_tokens, kv_max = sum(run.prompts) + run.width * steps, max(run.prompts) + steps
        dur = _decode_s(run.backend, run.width, kv_tokens, kv_max) * rng.lognormal(0, 0.03, steps.size)
        end = np.cumsum(dur)
        samples[run.key] = {"kv_tokens": kv_tokens.tolist(), "kv_max": kv_max.tolist(),
                            "start": (end - dur).tolist(), "end": end.tolist()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(CostModel(table), runs, samples)


def build_standin(out: Path, n: int = 80) -> tuple[Path, Path]:
    """A synthetic cost table (out/table.json) and a validation folder (out/validation) whose "real" records
    are simulator runs with step-time noise, shaped like the real ones: the plan `python -m sim validate plan`
    makes, every point and repeat, per-token times where the plan asks for them. No Azure point (its trace is
    not in CI)."""
    from calibrate.cost_model import CostModel
    from engine.block_pool import blocks_for_gib
    from sim import validate as V
    from sim.model import SimConfig, simulate
    from sim.synthetic import synthetic_table
    from traces.cost_table import save_cost_table
    from traces.records import RunWriter

    out.mkdir(parents=True, exist_ok=True)
    table = synthetic_table(_prefill_s, lambda b, r, t, m: float(_decode_s(b, r, t, m)), retire_s=1e-4,
                            sigma=0.05, name="stand-in (synthetic)")
    table["accuracy"] = _accuracy(table)
    save_cost_table(table, out / "table.json")
    vdir = out / "validation"
    points = V.make_plan(out / "table.json", vdir, n=n, azure=out / "no-azure-trace.csv")
    cost = CostModel(table)
    for p in points:
        trace = V.build_trace(p.trace, vdir)
        pool = blocks_for_gib(p.pool_gib) if p.pool_gib else 60000
        for k in range(1, p.repeats + 1):
            detail = "tokens" if getattr(p, "tokens", True) else "steps"
            rec = simulate(trace, cost, SimConfig(p.backend, p.max_batch, pool, 64, detail=detail,
                                                  noise_seed=k)).record
            meta = {**rec.meta, "kind": "engine", "device": {"name": "stand-in (simulated runs)"},
                    "software": {"torch": None, "triton": None}, "validation_point": p.id, "repeat": k}
            w = RunWriter(V.run_dir(vdir, p, k), meta)
            for t in ("requests", "steps", "tokens", "rejected"):
                w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
            w.close()
    return out / "table.json", vdir


# ---- running a notebook -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text('raise ImportError("the notebooks must not import torch")\n')
    return d


def run_notebook(name: str, figures: Path, no_torch: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SERVECAP_TABLE", "SERVECAP_VALIDATION", "FIGURES_DIR")}
    clean.update(MPLBACKEND="Agg", FIGURES_DIR=str(figures), PYTHONPATH=os.pathsep.join([str(no_torch), str(ROOT)]),
                 **env)
    return subprocess.run([sys.executable, str(NOTEBOOKS / f"{name}.py")], cwd=figures, env=clean,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def check_ran(name: str, proc: subprocess.CompletedProcess, figures: Path) -> None:
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                 f"--- stderr\n{proc.stderr[-5000:]}"
    for fig in FIGURES[name]:
        png = figures / f"{fig}.png"
        assert png.exists(), f"{name} did not write {png.name}; it wrote {sorted(p.name for p in figures.iterdir())}"
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{png.name} is not a PNG"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 300 and len(data) > 20_000, \
            f"{png.name} looks empty ({width}x{height}, {len(data)} bytes)"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIGURES))
def test_notebook_committed(name, tmp_path, no_torch):
    absent = [p for p in NEEDS[name] if not p.exists() or (p.name == "real" and not any(p.glob("*/run-*/meta.json")))]
    if absent:
        pytest.skip(f"{name}: committed data not there yet: {', '.join(str(p.relative_to(ROOT)) for p in absent)}")
    proc = run_notebook(name, tmp_path, no_torch)
    assert proc.returncode != MISSING_DATA, f"{name} says data is missing although it is committed:\n{proc.stderr}"
    check_ran(name, proc, tmp_path)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> tuple[Path, Path]:
    return build_standin(tmp_path_factory.mktemp("standin"))


@pytest.mark.slow
def test_notebooks_standin(standin, tmp_path, no_torch):
    """All five notebooks on the stand-in data, two at a time."""
    table, vdir = standin

    def one(name: str):
        figures = tmp_path / name
        figures.mkdir()
        return name, figures, run_notebook(name, figures, no_torch, SERVECAP_TABLE=str(table),
                                           SERVECAP_VALIDATION=str(vdir))

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(one, FIGURES))
    for name, figures, proc in done:
        check_ran(name, proc, figures)


def test_missing_data_is_one_clear_line(tmp_path, no_torch):
    """No table: the notebook stops with the missing file and the command that makes it, not a traceback."""
    absent = tmp_path / "nowhere" / "h200.json"
    proc = run_notebook("05_cost_table", tmp_path, no_torch, SERVECAP_TABLE=str(absent))
    assert proc.returncode == MISSING_DATA, proc.stderr
    assert str(absent) in proc.stderr and "python -m calibrate" in proc.stderr
    assert "Traceback" not in proc.stderr
    from sim.synthetic import constant_table
    from traces.cost_table import save_cost_table

    save_cost_table(constant_table(), tmp_path / "table.json")
    proc = run_notebook("02_sim_vs_real", tmp_path, no_torch, SERVECAP_TABLE=str(tmp_path / "table.json"),
                        SERVECAP_VALIDATION=str(tmp_path / "novalidation"))
    assert proc.returncode == MISSING_DATA, proc.stderr
    assert str(tmp_path / "novalidation" / "plan.json") in proc.stderr and "python -m sim validate plan" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_notebooks_are_percent_scripts():
    """Each notebook converts with jupytext into markdown and code cells."""
    jupytext = pytest.importorskip("jupytext")
    for name in FIGURES:
        nb = jupytext.read(NOTEBOOKS / f"{name}.py")
        kinds = [c.cell_type for c in nb.cells]
        assert kinds.count("markdown") >= 3 and kinds.count("code") >= 3, f"{name}: cells {kinds}"
        assert nb.cells[0].cell_type == "markdown", f"{name} should open with a markdown cell"


if __name__ == "__main__":
    table, vdir = build_standin(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 80)
    print(f"SERVECAP_TABLE={table} SERVECAP_VALIDATION={vdir}")
    print(json.dumps({k: v for k, v in json.loads((vdir / 'plan.json').read_text()).items() if k != "points"},
                     default=str)[:400])
