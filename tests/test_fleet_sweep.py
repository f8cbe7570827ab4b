"""Fleets and SLOs in the CLI and the sweep, the fewest-replicas answer, and sweeps on Modal (offline: the app, its
image, and the remote body run here with every input and output through pickle)."""
from __future__ import annotations

import inspect
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import linear_table, write_table

from sim import remote
from sim.cli import main
from sim.fleet_report import fewest_lines, fewest_replicas
from sim.sweep import Config, ConfigResult, Workload, run_sweep
from traces import metrics
from traces.records import read_run
from traces.slo import parse_slos

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse refuses malformed options itself
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_run_of_a_fleet_writes_one_record_with_replicas(capsys, table, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = cli(capsys, "run", "--rate", "4", "--n", "60", "--replicas", "2", "--router", "least-tokens",
                          "--slo", "ttft_p99=1,e2e=10", "--table", str(table), "--out", str(out))
    assert code == 0
    assert "fleet    2 replicas of that engine behind a least-tokens router" in stdout
    assert "SLOs     ttft_p99=1, e2el=10: goodput" in stdout and "replica  requests  share" in stdout
    rec = read_run(out)
    assert rec.meta["replicas"] == 2 and rec.meta["router"] == "least-tokens"
    assert set(rec.requests["replica"]) == {0, 1} and set(rec.steps["replica"]) == {0, 1}
    scored = metrics.summary(rec, 4.0, parse_slos("ttft_p99=1,e2e=10"))
    assert rec.meta["summary"]["goodput"] == scored["goodput"] and rec.meta["summary"]["slo_ok"] == scored["slo_ok"]


def test_cli_sweep_answers_the_fewest_replicas(capsys, table, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, _ = cli(capsys, "sweep", "--replicas", "1,2", "--router", "round-robin,least-outstanding",
                          "--rates", "1,2.5,6", "--slo", "ttft_p99=3", "--pool-gib", "2", "--max-batch", "8",
                          "--backend", "paged", "--n", "200", "--jobs", "2", "--table", str(table), "--out", str(out))
    assert code == 0
    assert "capacity by the SLOs: the highest rate at which ttft <= 3 s (and its p99), for all but 1% of requests" \
        in stdout
    assert "paged, max batch 8, pool 2 GiB, 2 replicas behind least-outstanding (1170 blocks): by the SLOs capacity " \
           "between 2.5 and 6 req/s; by stability" in stdout
    assert stdout.split("fewest replicas that meet the SLOs at each rate:\n")[1].split("\n\n")[0].splitlines() == [
        "  paged, max batch 8, pool 2 GiB, round-robin: rate 1 req/s -> 1",
        "  paged, max batch 8, pool 2 GiB, round-robin: rate 2.5 req/s -> 2",
        "  paged, max batch 8, pool 2 GiB, round-robin: rate 6 req/s -> none of 1,2",
        "  paged, max batch 8, pool 2 GiB, least-outstanding: rate 1 req/s -> 1",
        "  paged, max batch 8, pool 2 GiB, least-outstanding: rate 2.5 req/s -> 2",
        "  paged, max batch 8, pool 2 GiB, least-outstanding: rate 6 req/s -> none of 1,2"]
    points = pd.read_csv(out / "sweep.csv")
    assert list(points.columns[:6]) == ["backend", "max_batch", "pool_gib", "replicas", "router", "pool_blocks"]
    assert list(points.columns[-7:]) == ["sim_events", "sim_wall_s", "goodput", "good_fraction", "slo_ok",
                                         "attain_ttft", "ttft_p99"]
    assert len(points) == 12 and sorted(set(zip(points["replicas"], points["router"]))) == [
        (1, "least-outstanding"), (1, "round-robin"), (2, "least-outstanding"), (2, "round-robin")]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["capacity_by"] == "slos" and doc["slos"] == ["ttft_p99=3"]
    assert [f["replicas"] for f in doc["fewest_replicas"]] == [1, 2, None, 1, 2, None]
    assert {(c["replicas"], c["router"], c["slo_capacity_lo"], c["slo_capacity_hi"]) for c in doc["configurations"]} \
        == {(1, "round-robin", 1.0, 2.5), (1, "least-outstanding", 1.0, 2.5), (2, "round-robin", 2.5, 6.0),
            (2, "least-outstanding", 2.5, 6.0)}


def _row(rate: float, ok: bool) -> dict:
    return {"rate": rate, "stable": True, "slo_ok": ok}  # stable everywhere; the SLOs say otherwise


def test_fewest_replicas_by_hand():
    # Replica counts 1, 2, 4 of one configuration, stable everywhere, against SLOs: rate 10 met by 1; rate 20 by 4
    # alone; rate 30 by none. Rate 40 was tried with 4 replicas only, so no count answers it.
    slos = parse_slos("ttft=1")
    results = [ConfigResult(Config("paged", 32, 4.0, replicas=n, router="least-tokens"), 100, rates, None,
                            [_row(r, ok) for r, ok in zip(rates, oks)])
               for n, rates, oks in [(4, [10, 20, 30, 40], [True, True, False, True]),
                                     (1, [10, 20, 30], [True, False, False]), (2, [10, 20, 30], [True, False, False])]]
    found = fewest_replicas(results, slos)
    assert [(f["rate"], f["replicas"], f["tested"]) for f in found] == [(10, 1, [1, 2, 4]), (20, 4, [1, 2, 4]),
                                                                         (30, None, [1, 2, 4])]
    assert {(f["configuration"], f["router"]) for f in found} == {("paged, max batch 32, pool 4 GiB", "least-tokens")}
    assert [f["replicas"] for f in fewest_replicas(results, ())] == [1, 1, 1]  # by stability
    assert fewest_lines(found, slos) == [
        "fewest replicas that meet the SLOs at each rate:",
        "  paged, max batch 32, pool 4 GiB, least-tokens: rate 10 req/s -> 1",
        "  paged, max batch 32, pool 4 GiB, least-tokens: rate 20 req/s -> 4",
        "  paged, max batch 32, pool 4 GiB, least-tokens: rate 30 req/s -> none of 1,2,4"]
    assert fewest_lines([], ()) == ["fewest replicas that stay stable at each rate:",
                                    "  no rate was tested at every replica count (give --rates)"]


@pytest.mark.parametrize("args, message", [
    (["run", "--rate", "1", "--replicas", "0"], "argument --replicas: '0' is not a whole number >= 1"),
    (["run", "--rate", "1", "--router", "fastest"], "argument --router: 'fastest' is not a router (round-robin, "
                                                   "least-outstanding, least-tokens)"),
    (["run", "--rate", "1", "--slo", "ttft_p99=abc"], "argument --slo: 'ttft_p99=abc': the limit must be a positive"),
    (["sweep", "--replicas", "1,0"], "argument --replicas: '0' is not a whole number >= 1"),
    (["sweep", "--router", "round-robin,random"], "argument --router: 'random' is not a router"),
    (["sweep", "--slo", "ttft_p99=2,latency=3"], "argument --slo: 'latency=3': unknown SLO metric 'latency'"),
])
def test_cli_refuses_bad_fleet_and_slo_options(capsys, table, tmp_path, args, message):
    out = tmp_path / "out"
    code, _, err = cli(capsys, *args, "--table", str(table), "--out", str(out))
    assert code == 2 and message in err.splitlines()[-1]
    assert not out.exists()


# --- on Modal ---------------------------------------------------------------------------------------------------

def _dockerfile(image) -> list[str]:
    """The Dockerfile commands of a Modal image's layers, base first (read from the layers' build closures)."""
    from modal._utils.async_utils import synchronizer
    layer, commands = synchronizer._translate_in(image), []
    while layer is not None:
        bound = inspect.getclosurevars(layer._load).nonlocals
        if bound.get("dockerfile_function"):
            commands = bound["dockerfile_function"]("2024.10").commands + commands
        layer = bound.get("base_image") or next(iter((bound.get("base_images") or {}).values()), None)
    return commands


def test_the_modal_app_holds_the_simulator_and_no_torch():
    modal_app = pytest.importorskip("sim.modal_app")
    from modal._utils.async_utils import synchronizer
    spec = modal_app.sweep_call._spec_
    assert spec.image is synchronizer._translate_in(modal_app.image) and spec.gpus is None and spec.cpu == 1.0
    commands = _dockerfile(modal_app.image)
    installs = [c for c in commands if c.startswith("RUN python -m pip install")]
    assert installs == ["RUN python -m pip install " + " ".join(sorted(modal_app.PACKAGES))]
    assert not any("torch" in c or "triton" in c or "transformers" in c for c in commands)
    assert synchronizer._translate_in(modal_app.image)._added_python_source_set == set(modal_app.SOURCES)


def test_the_image_sources_hold_every_package_the_simulator_imports():
    modal_app = pytest.importorskip("sim.modal_app")
    code = """
import sys
from pathlib import Path
import sim.modal_app, sim.cli
repo = Path.cwd().resolve()
print(sorted({m.partition(".")[0] for m, mod in list(sys.modules.items())
              if getattr(mod, "__file__", None) and Path(mod.__file__).resolve().is_relative_to(repo)}))
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "triton", "transformers")))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours, heavy = map(eval, done.stdout.splitlines())
    assert set(ours) <= set(modal_app.SOURCES) and "sim" in ours and heavy == []


class PickledMap:
    """Function.map as Modal runs it, here: every input and output through pickle, each call made by the Modal
    function's own body (.local), and the outputs handed back last first, as unordered outputs may come."""

    def __init__(self, function):
        self.function = function

    def map(self, *inputs, kwargs: dict, order_outputs: bool):
        assert order_outputs is False
        outputs = []
        for args in zip(*inputs):
            args, kw = pickle.loads(pickle.dumps((args, kwargs)))
            outputs.append(pickle.loads(pickle.dumps(self.function.local(*args, **kw))))
        return iter(outputs[::-1])


def test_a_sweep_on_modal_gives_the_rows_a_local_sweep_gives(monkeypatch):
    modal_app = pytest.importorskip("sim.modal_app")
    monkeypatch.setattr(remote, "_ready", None)
    from costs.table import as_cost_table
    table = as_cost_table(linear_table())
    configs = [Config("paged", 8, 1.0), Config("padded", 8, 1.0, "packed", 2, "least-tokens")]
    kw = dict(strict=False, noise_seed=3, jobs=1, progress=False, slos=parse_slos("ttft_p99=2,tpot=0.05"))
    local, local_warned = run_sweep(table, configs, None, Workload(30, 1), **kw)  # automatic rates: estimates too
    away, away_warned = run_sweep(table, configs, None, Workload(30, 1), remote=remote.map_with(PickledMap(
        modal_app.sweep_call)), **kw)
    assert away_warned == local_warned
    for a, b in zip(local, away):
        assert (a.config, a.rates, a.estimate, a.pool_blocks) == (b.config, b.rates, b.estimate, b.pool_blocks)
        # NaN (no request queued, say) is not == NaN once pickled; frames compare it as equal
        pd.testing.assert_frame_equal(pd.DataFrame(a.rows).drop(columns="sim_wall_s"),
                                      pd.DataFrame(b.rows).drop(columns="sim_wall_s"), check_exact=True)
    assert len(away[1].rows) == 12 and away[1].rows[0]["replicas"] == 2 and "slo_ok" in away[1].rows[0]


def test_on_modal_without_the_package_is_one_line(tmp_path):
    table = write_table(linear_table(), tmp_path / "t.json")
    code = f"""
import importlib.abc, sys

class NoModal(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "modal":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, NoModal())
import sim.cli
sys.exit(sim.cli.main(["sweep", "--on", "modal", "--rates", "1", "--n", "10", "--table", {str(table)!r},
                       "--out", {str(tmp_path / 'out')!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == \
        "sim: error: --on modal needs the modal package: pip install -e '.[modal]', then modal setup\n"
    assert not (tmp_path / "out").exists()
