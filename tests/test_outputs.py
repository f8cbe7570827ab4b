"""What the tools write for people and other programs: sweep files whose rows never share their keys and whose
figure tells every configuration apart, timelines that hold fleets and whose events never overlap after a
reader's truncation, run records that pandas reads as they are (and old ones still read), and the set-up and
messages a new user meets first."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.costs.model import CostModel
from servecap.costs.table import load_cost_table
from helpers import linear_table, run_cli, sim_config, write_table
from servecap.sim.cli import main as sim_main
from servecap.sim.fleet import simulate_fleet
from servecap.sim.fleet_report import fewest_replicas
from servecap.sim.simulator import simulate
from servecap.sim.sweep import ConfigResult
from servecap.sim.sweep_plot import _styles, channels, title
from servecap.traces import records
from servecap.traces.cli import main as traces_main
from servecap.traces.errors import InputError
from servecap.traces.records import RunWriter, read_run
from servecap.traces.timeline import timeline
from servecap.traces.trace_io import read_trace
from servecap.traces.workload import poisson_trace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


@pytest.fixture(scope="module")
def cost(table) -> CostModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CostModel(load_cost_table(table))


# --- sweeps --------------------------------------------------------------------------------------------------

KEYS = ["backend", "prefill", "max_batch", "pool_gib", "replicas", "router", "rate", "seed"]


def test_a_sweep_of_policies_and_fleets_keys_every_row_and_runs_one_engine_once(capsys, table, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, err = run_cli(sim_main, capsys, "sweep", "--prefill", "padded,packed,chunked:256", "--replicas",
                                "1,2", "--router", "round-robin,least-tokens", "--rates", "1,2", "--max-batch", "8",
                                "--pool-gib", "1", "--backend", "paged", "--n", "60", "--jobs", "1", "--table",
                                str(table), "--out", str(out))
    assert code == 0, err
    points = pd.read_csv(out / "sweep.csv")
    # 3 policies x (one engine + 2 fleets) x 2 rates; one engine is not run once per router
    assert len(points) == 18 and not points.duplicated(KEYS).any()
    assert set(points["prefill"]) == {"padded", "packed", "chunked:256"}
    assert sorted(set(zip(points["replicas"], points["router"]))) == [(1, "round-robin"), (2, "least-tokens"),
                                                                      (2, "round-robin")]
    doc = json.loads((out / "sweep.json").read_text())
    assert len({tuple(p[k] for k in KEYS) for p in doc["points"]}) == len(doc["points"]) == 18
    # Printed once per configuration: 9, with no single engine "behind" a router
    assert stdout.count("(585 blocks)") == 9 and "1 replica behind" not in stdout
    # The offered rate (what the sample offered, which stability compares the served rate with) beside the nominal
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rate "))
    assert lines[head].split()[:3] == ["rate", "offered", "served"]
    row = points.iloc[0]  # the first configuration's first rate, as printed first
    assert lines[head + 1].split()[:3] == ["1", f"{row['expected_rate']:.2f}", f"{row['served_rate']:.2f}"]
    assert row["expected_rate"] != row["rate"]
    fewest = doc["fewest_replicas"]
    assert sorted((f["router"], f["rate"], f["tested"] == [1, 2]) for f in fewest if f["configuration"] ==
                  "paged, max batch 8, pool 1 GiB") == [("least-tokens", 1, True), ("least-tokens", 2, True),
                                                        ("round-robin", 1, True), ("round-robin", 2, True)]


def test_fewest_replicas_counts_the_single_engine_under_every_router():
    rows = [{"rate": 5, "stable": True, "slo_ok": True}]
    results = [ConfigResult(ServingConfig(max_batch=8, pool=PoolSize(gib=1.0), replicas=n, router=r), 100, [5], None, list(rows))
               for n, r in ((1, "least-tokens"), (2, "least-tokens"), (2, "least-outstanding"))]
    assert results[0].config.router == "round-robin"  # whatever it was named under: one engine has no router
    found = fewest_replicas(results, ())
    assert sorted((f["router"], f["replicas"], tuple(f["tested"])) for f in found) == [
        ("least-outstanding", 1, (1, 2)), ("least-tokens", 1, (1, 2))]


def test_sweep_figure_gives_every_varied_axis_a_channel_and_names_its_inputs():
    configs = [ServingConfig(max_batch=8, pool=PoolSize(gib=1.0), prefill=p, replicas=n, router=r) for p in ("padded", "packed", "chunked:256")
               for n, r in ((1, "round-robin"), (2, "round-robin"), (2, "least-tokens"))]
    assert channels(configs) == {"prefill": "colour", "fleet": "marker"}
    styles, _ = _styles(configs)
    looks = {tuple(sorted((k, str(v)) for k, v in s.items())) for s in styles}
    assert len(looks) == len(configs)  # no two configurations look alike
    six = [ServingConfig(backend=b, max_batch=m, pool=PoolSize(gib=g), prefill=p, replicas=n, router="least-tokens")
           for b in ("paged", "dense") for m in (8, 16) for g in (1.0, 2.0)
           for p in ("padded", "packed") for n in (1, 2)]
    assert set(channels(six).values()) == {"colour", "marker", "line", "fill", "width"}
    assert len({tuple(sorted((k, str(v)) for k, v in s.items())) for s in _styles(six)[0]}) == len(six)
    assert title({"workload": {"kind": "poisson", "n": 400, "seeds": [0, 1, 2]}, "table": {"id": "abc123"}}) == \
        "seeded poisson trace, n = 400, seeds 0-2; cost table abc123"
    assert title({"workload": {"trace_file": "t.csv", "trace_id": "f00", "n": 50}, "table": {"id": "abc"}}) == \
        "trace t.csv (id f00), n = 50; cost table abc"


def test_sweep_png_keeps_its_legend_inside_the_image(capsys, table, tmp_path):
    """The legend sits below the axes, in the saved image: a figure cropped to its axes (the old layout, legend
    drawn over a fixed margin) loses entries once there are more than a few."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import image
    out = tmp_path / "sweep"
    code, _, err = run_cli(sim_main, capsys, "sweep", "--prefill", "padded,packed", "--pool-gib", "0.5,1,2,4",
                           "--max-batch", "8,16", "--rates", "1", "--backend", "paged", "--n", "40", "--jobs", "1",
                           "--table", str(table), "--out", str(out))
    assert code == 0, err
    png = image.imread(out / "sweep.png")
    height, width = png.shape[:2]
    # 16 configurations in two columns below two 6-inch-high axes: the image is taller than the figure was
    assert height > 6 * 110 + 8 * 12 and width >= 13 * 100


# --- timelines -----------------------------------------------------------------------------------------------

def _ns(us) -> int:
    return int(us * 1000)  # what a reader makes of a JSON microsecond value: whole nanoseconds, truncated


def _check_no_overlap(events: list[dict]) -> int:
    """Every pair of consecutive complete events on one track, in whole nanoseconds as a reader has them, does
    not overlap; the pairs checked."""
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append(e)
    pairs = 0
    for (pid, tid), track in tracks.items():
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert isinstance(a["ts"], int) and isinstance(a["dur"], int), a
            assert _ns(a["ts"]) + _ns(a["dur"]) <= _ns(b["ts"]), (pid, tid, a, b)
            pairs += 1
    return pairs


@pytest.mark.parametrize("every_step", [False, True])
def test_no_two_consecutive_step_events_overlap(cost, every_step):
    # 40 req/s on the linear table: thousands of steps back to back, whose float microsecond times of the old
    # writer overlapped their successors by a nanosecond after truncation
    rec = simulate(poisson_trace(40, 400, 0), cost, sim_config(max_batch=32, pool_blocks=4000, detail="steps")).record
    events = timeline([rec], every_step=every_step)["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(steps) > 200
    assert _check_no_overlap(events) > len(steps)  # the steps and every batch row's requests


def test_a_fleet_gets_one_process_per_replica(cost):
    cfg = sim_config(max_batch=8, pool_blocks=1000, detail="steps", replicas=3, router="least-tokens")
    rec = simulate_fleet(poisson_trace(20, 200, 1), cost, cfg).record
    events = timeline([rec], ["sim"])["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "sim replica 0", 2: "sim replica 1", 3: "sim replica 2"}
    for pid in (1, 2, 3):  # each replica's own steps, rows and counters
        mine = [e for e in events if e["pid"] == pid]
        assert {"prefill", "decode", "queue depth", "free KV blocks"} <= {e["name"] for e in mine}
    requests = sorted(int(e["name"].split()[1]) for e in events if e["name"].startswith("request "))
    assert requests == sorted(rec.requests["request_id"])
    _check_no_overlap(events)


def test_sim_run_of_a_fleet_writes_its_timeline(capsys, table, tmp_path):
    out = tmp_path / "t.json"
    code, stdout, err = run_cli(sim_main, capsys, "run", "--rate", "4", "--n", "60", "--replicas", "2",
                                "--table", str(table), "--trace-events", str(out))
    assert code == 0, err
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"sim replica 0", "sim replica 1"}


# --- run records -----------------------------------------------------------------------------------------------

def test_run_record_tables_read_as_they_are_with_pandas(cost, tmp_path):
    rec = simulate(poisson_trace(10, 100, 0), cost, sim_config(max_batch=8, pool_blocks=1000, detail="tokens")).record
    w = RunWriter(tmp_path / "run", rec.meta)
    for t in ("requests", "steps", "tokens", "rejected"):
        w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    w.close()
    for t, cols in records.TABLES.items():
        df = pd.read_csv(tmp_path / "run" / f"{t}.csv")  # no comment='#', no skiprows
        assert list(df.columns) == list(cols)
        assert len(df) == len(getattr(rec, t))
    back = read_run(tmp_path / "run")
    for t in ("requests", "steps", "tokens"):
        pd.testing.assert_frame_equal(getattr(back, t), getattr(rec, t), check_exact=True)
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "run" / f"{t}.csv"), getattr(rec, t),
                                      check_exact=False, rtol=1e-15)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert (meta["schema"], meta["version"]) == ("run-record", 5)
    assert meta["tables"]["steps"] == list(records.STEP_COLUMNS)


COMMITTED = {1: REPO / "results/wave1/validation/real/closed-p256-8/run-1",
             2: REPO / "results/validation/real/closed-mixed-32/run-1"}


@pytest.mark.parametrize("version", sorted(COMMITTED))
def test_committed_records_of_earlier_versions_still_read(version, tmp_path, monkeypatch):
    run = COMMITTED[version]
    if not run.exists():
        pytest.skip(f"{run} is not in this checkout")
    assert json.loads((run / "meta.json").read_text())["version"] == version
    assert (run / "requests.csv").read_text().startswith('# {"schema": "run-record/requests"')
    rec = read_run(run)
    assert len(rec.requests) > 0 and len(rec.steps) > 0 and list(rec.steps.columns) == list(records.STEP_COLUMNS)
    # the same frames as the strict line-by-line reader gives
    monkeypatch.setattr(records, "read_frame", lambda *a, **k: None)
    strict = read_run(run)
    for t in records.TABLES:
        pd.testing.assert_frame_equal(getattr(rec, t), getattr(strict, t), check_exact=True)


def test_a_record_with_a_short_row_is_refused_naming_its_line(tmp_path):
    w = RunWriter(tmp_path / "run", {"kind": "engine"})
    w.add_many("requests", [(i, 0.1 * i, 0.1 * i, i, i, 1, 0.2 * i, 0.3 * i, 16, 4, 1, 0, 0, 0, 0)
                               for i in range(5)])
    w.close()
    p = tmp_path / "run" / "requests.csv"
    lines = p.read_text().splitlines(keepends=True)
    lines[3] = "2,0.2,0.2\n"  # pandas would fill the missing fields with NaN
    p.write_text("".join(lines))
    with pytest.raises(InputError, match="line 4: has 3 fields, the header has 15"):
        read_run(tmp_path / "run")


# --- set-up and first messages ---------------------------------------------------------------------------------

def test_a_raw_azure_csv_given_as_a_trace_names_the_importer(capsys, tmp_path):
    raw = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    raw.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    with pytest.raises(InputError, match="import it first with `python -m traces import-azure"):
        read_trace(raw)
    code, _, err = run_cli(sim_main, capsys, "run", "--trace", str(raw))
    assert code == 2 and "import-azure" in err and "header line" not in err and len(err.splitlines()) == 1


def test_a_raw_mooncake_jsonl_given_as_a_trace_names_its_importer(capsys, tmp_path):
    raw = tmp_path / "mooncake_trace.jsonl"
    raw.write_text('{"timestamp": 0, "input_length": 700, "output_length": 6, "hash_ids": [0, 1]}\n')
    code, _, err = run_cli(sim_main, capsys, "run", "--trace", str(raw))
    assert code == 2 and "import-mooncake" in err and "header line" not in err and len(err.splitlines()) == 1
    # The command it names makes a trace the simulator runs.
    out = tmp_path / "trace.csv"
    assert traces_main(["import-mooncake", str(raw), "--out", str(out)]) == 0
    assert read_trace(out).requests[0].prompt_tokens == 700


def test_an_import_says_how_many_requests_the_model_cannot_hold(capsys, tmp_path):
    raw = tmp_path / "mooncake_trace.jsonl"
    raw.write_text('{"timestamp": 0, "input_length": 700, "output_length": 6, "hash_ids": [0, 1]}\n'
                   f'{{"timestamp": 5, "input_length": 40160, "output_length": 6, "hash_ids": {list(range(2, 81))}}}\n')
    assert traces_main(["import-mooncake", str(raw), "--out", str(tmp_path / "all.csv")]) == 0
    err = capsys.readouterr().err
    assert "1 requests are beyond qwen2.5-1.5b's 32768 positions" in err and "--max-prompt" in err
    assert traces_main(["import-mooncake", str(raw), "--out", str(tmp_path / "kept.csv"), "--max-prompt", "32000"]) == 0
    assert "beyond" not in capsys.readouterr().err


def test_explain_names_requests_over_wall_time_the_served_rate(capsys, cost, tmp_path):
    rec = simulate(poisson_trace(10, 60, 0), cost, sim_config(max_batch=8, pool_blocks=1000, detail="steps")).record
    w = RunWriter(tmp_path / "run", rec.meta, ("requests", "steps", "rejected"))
    for t in ("requests", "steps", "rejected"):
        w.add_many(t, getattr(rec, t).itertuples(index=False, name=None))
    w.close()
    assert traces_main(["explain", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    head = next(line for line in text.splitlines() if "wall time" in line and "requests" in line)
    assert "req/s over the wall time" in head and "offered" not in head


def _fake_venv(root: Path) -> Path:
    """scripts/run.sh in a copy of the repository whose .venv/bin/python logs each call instead of running."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run.sh", root / "scripts" / "run.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    py = root / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\n')
    py.chmod(0o755)
    return root / ".venv" / "calls"


def test_run_sh_installs_only_when_pyproject_changed(tmp_path):
    calls = _fake_venv(tmp_path)

    def run() -> list[str]:
        calls.unlink(missing_ok=True)
        subprocess.run(["bash", str(tmp_path / "scripts" / "run.sh"), "--help"], check=True,
                       env={**os.environ, "PATH": os.environ["PATH"]})
        return calls.read_text().splitlines()

    first = run()
    assert any("pip install -q -e ." in c for c in first) and first[-1] == "-m servecap.sim --help"
    assert run() == ["-m servecap.sim --help"]  # nothing changed: no install
    with open(tmp_path / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    assert any("pip install -q -e ." in c for c in run())


def test_readme_says_how_to_activate_the_venv_and_names_the_console_scripts():
    import tomllib
    readme = (REPO / "README.md").read_text()
    assert ". .venv/bin/activate" in readme
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts and all(f"`{name}`" in readme for name in scripts)
