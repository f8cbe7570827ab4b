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
from helpers import linear_table, run_cli, write_table

from servecap.sim import remote
from servecap.sim.cli import main
from servecap.sim.fleet_report import fewest_lines, fewest_replicas
from servecap.sim.report import MEMORY_COLUMNS
from servecap.core.block_pool import PoolSize
from servecap.core.config import ServingConfig
from servecap.sim.sweep import ConfigResult, Workload, run_sweep
from servecap.traces import metrics
from servecap.traces.latency import latency_keys
from servecap.traces.records import read_run
from servecap.traces.slo import parse_slos

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    return write_table(linear_table(), tmp_path_factory.mktemp("tables") / "linear.json")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    return run_cli(main, capsys, *argv)


def test_cli_run_of_a_fleet_writes_one_record_with_replicas(capsys, table, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = cli(capsys, "run", "--rate", "4", "--n", "60", "--replicas", "2", "--router", "least-tokens",
                          "--slo", "ttft_p99=1,e2e=10", "--table", str(table), "--out", str(out))
    assert code == 0
    assert "fleet    2 replicas of that engine behind a least-tokens router" in stdout
    assert "SLOs     ttft <= 1000 ms (and its p99), e2el <= 10000 ms: goodput" in stdout and "replica  requests  share" in stdout
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
    assert "capacity by the SLOs: the highest rate at which ttft <= 3000 ms (and its p99), for all but 1% of requests" \
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
    assert list(points.columns[:7]) == ["backend", "prefill", "max_batch", "pool_gib", "replicas", "router",
                                        "pool_blocks"]
    tail = len(latency_keys()) + len(MEMORY_COLUMNS)  # the latencies, then the admission and cache axes, come last
    assert list(points.columns[-6 - tail:-tail]) == [
        "sim_events", "goodput", "good_fraction", "slo_ok", "attain_ttft", "ttft_p99"]
    assert tuple(points.columns[-len(MEMORY_COLUMNS):]) == MEMORY_COLUMNS
    # One engine has no router: it runs once, not once per router
    assert len(points) == 9 and sorted(set(zip(points["replicas"], points["router"]))) == [
        (1, "round-robin"), (2, "least-outstanding"), (2, "round-robin")]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["capacity_by"] == "slos" and doc["slos"] == ["ttft_p99=3"]
    assert [f["replicas"] for f in doc["fewest_replicas"]] == [1, 2, None, 1, 2, None]
    assert {(c["replicas"], c["router"], c["slo_capacity_lo"], c["slo_capacity_hi"]) for c in doc["configurations"]} \
        == {(1, "round-robin", 1.0, 2.5), (2, "round-robin", 2.5, 6.0), (2, "least-outstanding", 2.5, 6.0)}


def _row(rate: float, ok: bool) -> dict:
    return {"rate": rate, "stable": True, "slo_ok": ok}  # stable everywhere; the SLOs say otherwise


def test_fewest_replicas_by_hand():
    # Replica counts 1, 2, 4 of one configuration, stable everywhere, against SLOs: rate 10 met by 1; rate 20 by 4
    # alone; rate 30 by none. Rate 40 was tried with 4 replicas only, so no count answers it.
    slos = parse_slos("ttft=1")
    results = [ConfigResult(ServingConfig(max_batch=32, pool=PoolSize(gib=4.0), replicas=n, router="least-tokens"),
                            100, rates, None,
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
    modal_app = pytest.importorskip("servecap.sim.modal_app")
    from modal._utils.async_utils import synchronizer
    spec = modal_app.sweep_call._spec_
    assert spec.image is synchronizer._translate_in(modal_app.image) and spec.gpus is None and spec.cpu == 1.0
    commands = _dockerfile(modal_app.image)
    installs = [c for c in commands if c.startswith("RUN python -m pip install")]
    assert installs == ["RUN python -m pip install " + " ".join(sorted(modal_app.PACKAGES))]
    assert not any("torch" in c or "triton" in c or "transformers" in c for c in commands)
    assert synchronizer._translate_in(modal_app.image)._added_python_source_set == set(modal_app.SOURCES)


def test_the_image_sources_hold_every_package_the_simulator_imports():
    modal_app = pytest.importorskip("servecap.sim.modal_app")
    code = """
import sys
from pathlib import Path
import servecap.sim.modal_app
import servecap.sim.cli
repo, env = Path.cwd().resolve(), Path(sys.prefix).resolve()  # a virtual environment may sit inside the repo
print(sorted({".".join(m.split(".")[:2]) for m, mod in list(sys.modules.items())
              if getattr(mod, "__file__", None) and Path(mod.__file__).resolve().is_relative_to(repo)
              and not Path(mod.__file__).resolve().is_relative_to(env)}))
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "triton", "transformers")))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours, heavy = map(eval, done.stdout.splitlines())
    # The image holds the whole package; the simulator's imports stay out of its engine.
    assert {m.partition(".")[0] for m in ours} <= set(modal_app.SOURCES) and "servecap.sim" in ours
    assert "servecap.engine" not in ours and heavy == []


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
    modal_app = pytest.importorskip("servecap.sim.modal_app")
    monkeypatch.setattr(remote, "_ready", None)
    from servecap.costs.table import as_cost_table
    table = as_cost_table(linear_table())
    configs = [ServingConfig(max_batch=8, pool=PoolSize(gib=1.0)),
               ServingConfig(backend="padded", max_batch=8, pool=PoolSize(gib=1.0), prefill="packed", replicas=2,
                             router="least-tokens")]
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
import servecap.sim.cli
from servecap import sim
sys.exit(sim.cli.main(["sweep", "--on", "modal", "--rates", "1", "--n", "10", "--table", {str(table)!r},
                       "--out", {str(tmp_path / 'out')!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == \
        "sim: error: --on modal needs the modal package: pip install -e '.[modal]', then modal setup\n"
    assert not (tmp_path / "out").exists()


# --- fleets, SLOs and seeds with the points store: resume, and remote sweeps keeping their points -------------

FLEET_SWEEP = ["sweep", "--replicas", "1,2", "--router", "round-robin,least-tokens", "--slo", "ttft_p99=3",
               "--seeds", "0-1", "--rates", "1,2.5", "--pool-gib", "2", "--max-batch", "8", "--backend", "paged",
               "--n", "200"]


def _same_sweep(a: Path, b: Path) -> None:
    """Two sweeps' files are the same bytes, wherever their points ran; only sweep.run.json says when, where and
    how fast each ran."""
    for name in ("sweep.csv", "sweep.bands.csv", "sweep.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _cut(whole: Path, cut: Path, keep: int) -> None:
    """`cut` as a sweep interrupted after `keep` results, a further one cut off mid-line by the kill."""
    from servecap.sim.store import FILE
    lines = (whole / FILE).read_text().splitlines(keepends=True)
    cut.mkdir()
    (cut / FILE).write_text("".join(lines[:1 + keep]) + lines[1 + keep][:30])


def test_a_fleet_sweep_with_slos_and_seeds_resumes_to_the_same_results(capsys, table, tmp_path):
    from servecap.sim.store import FILE
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    code, stdout, err = cli(capsys, *FLEET_SWEEP, "--jobs", "2", "--table", str(table), "--out", str(whole))
    assert code == 0, err
    lines = [json.loads(line) for line in (whole / FILE).read_text().splitlines()]
    keys = [json.loads(e["key"]) for e in lines[1:]]
    # 3 configurations (one engine, two fleets) x 2 seeds x 2 rates, each under its replicas, router, seed and rate
    assert len(keys) == 12 and lines[0]["setup"]["slos"] == ["ttft_p99=3"]
    assert {(k[1]["replicas"], k[1]["router"], k[2], k[3]) for k in keys} == \
        {(n, r, s, rate) for n, r in ((1, "round-robin"), (2, "round-robin"), (2, "least-tokens")) for s in (0, 1)
         for rate in (1, 2.5)}
    bands = pd.read_csv(whole / "sweep.bands.csv")
    assert len(bands) == 6 and {"replicas", "router", "slo_ok_seeds", "goodput_mean"} <= set(bands.columns)
    assert "SLOs met seeds" in stdout and "by the SLOs highest SLO-meeting rate" in stdout
    doc = json.loads((whole / "sweep.json").read_text())
    # At 2.5 req/s two replicas meet the SLOs on both seeds behind least-tokens, on one of the two behind round-robin
    # (seed 1's TTFT p99 is 3.9 s): a count holds a rate when most seeds do.
    rr = pd.read_csv(whole / "sweep.csv").query("replicas == 2 and router == 'round-robin' and rate == 2.5")
    assert list(rr["slo_ok"]) == [True, False]
    assert [f["replicas"] for f in doc["fewest_replicas"]] == [1, None, 1, 2]
    assert all("slo_capacity_lo_band" in c and c["seeds"] == [0, 1] for c in doc["configurations"])

    _cut(whole, cut, 5)
    code, stdout, err = cli(capsys, *FLEET_SWEEP, "--jobs", "2", "--table", str(table), "--out", str(cut),
                            "--resume")
    assert code == 0 and "resuming: 5 results already in" in stdout, err
    _same_sweep(whole, cut)
    # Other SLOs are another sweep: its points would be scored against other limits.
    _cut(whole, tmp_path / "other", 5)
    code, _, err = cli(capsys, *FLEET_SWEEP[:6], "ttft_p99=2", *FLEET_SWEEP[7:], "--table", str(table), "--out",
                       str(tmp_path / "other"), "--resume")
    assert code == 2 and "was written by another sweep (its slos differ" in err


class CutMap(PickledMap):
    """PickledMap that hands back its outputs one at a time, as they finish, and is interrupted (Ctrl-C) after
    `stop` of them; it counts the inputs it was given."""

    def __init__(self, function, stop: int | None = None):
        super().__init__(function)
        self.stop, self.sent = stop, 0

    def map(self, *inputs, kwargs: dict, order_outputs: bool):
        inputs = [list(i) for i in inputs]
        self.sent += len(inputs[0])
        for n, out in enumerate(super().map(*inputs, kwargs=kwargs, order_outputs=order_outputs)):
            if n == self.stop:
                raise KeyboardInterrupt
            yield out


def test_a_sweep_on_modal_keeps_its_points_as_they_come_back_and_resumes(monkeypatch, tmp_path):
    modal_app = pytest.importorskip("servecap.sim.modal_app")
    from servecap.costs.table import as_cost_table
    from servecap.sim.store import FILE, PointStore
    monkeypatch.setattr(remote, "_ready", None)
    table = as_cost_table(linear_table())
    configs = [ServingConfig(max_batch=8, pool=PoolSize(gib=1.0), replicas=2, router="least-outstanding"),
               ServingConfig(max_batch=8, pool=PoolSize(gib=1.0))]
    kw = dict(strict=False, noise_seed=None, jobs=1, progress=False, slos=parse_slos("ttft_p99=2"), seeds=[0, 3])
    local, _ = run_sweep(table, configs, [1.0, 3.0], Workload(30, 0), **kw)
    setup = {"sweep": "on modal"}
    store = PointStore(tmp_path / FILE, setup)
    cut = CutMap(modal_app.sweep_call, stop=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(table, configs, [1.0, 3.0], Workload(30, 0), remote=remote.map_with(cut), store=store, **kw)
    store.close()
    assert cut.sent == 8 and (tmp_path / FILE).read_text().count("\n") == 1 + 3  # the three that came back
    store = PointStore(tmp_path / FILE, setup, resume=True)
    rest = CutMap(modal_app.sweep_call)
    away, _ = run_sweep(table, configs, [1.0, 3.0], Workload(30, 0), remote=remote.map_with(rest), store=store, **kw)
    store.close()
    assert rest.sent == 5 and (tmp_path / FILE).read_text().count("\n") == 1 + 8
    for a, b in zip(local, away):
        assert (a.config, a.seed, a.rates) == (b.config, b.seed, b.rates)
        # (a row read back from the points file has its keys in sorted order)
        pd.testing.assert_frame_equal(pd.DataFrame(a.rows).drop(columns="sim_wall_s"),
                                      pd.DataFrame(b.rows).drop(columns="sim_wall_s"), check_exact=True,
                                      check_like=True)


def test_cli_sweep_on_modal_resumes_a_local_one_and_writes_its_files(capsys, monkeypatch, table, tmp_path):
    modal_app = pytest.importorskip("servecap.sim.modal_app")
    from contextlib import contextmanager
    monkeypatch.setattr(remote, "_ready", None)
    maps = []

    @contextmanager
    def offline():
        maps.append(CutMap(modal_app.sweep_call))
        yield remote.map_with(maps[-1])

    monkeypatch.setattr(modal_app, "mapper", offline)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli(capsys, *FLEET_SWEEP, "--jobs", "1", "--table", str(table), "--out", str(whole))[0] == 0
    _cut(whole, cut, 6)
    code, stdout, err = cli(capsys, *FLEET_SWEEP, "--on", "modal", "--table", str(table), "--out", str(cut),
                            "--resume")
    assert code == 0 and "resuming: 6 results already in" in stdout, err
    assert [m.sent for m in maps] == [12 - 6]
    _same_sweep(whole, cut)
    assert json.loads((cut / "sweep.run.json").read_text())["on"] == "modal"
    code, _, err = cli(capsys, *FLEET_SWEEP, "--on", "modal", "--jobs", "2", "--table", str(table), "--out",
                       str(tmp_path / "jobs"))
    assert code == 2 and "--jobs does nothing with --on modal" in err and not (tmp_path / "jobs").exists()


def test_a_sweep_keeps_the_admission_and_cache_axes_apart(capsys, table, tmp_path):
    """Each admission policy and cache setting is its own configuration, in sweep.csv under its own name (they had
    once been dropped from the file, so two configurations read as one)."""
    out = tmp_path / "sweep"
    code, _, _ = cli(capsys, "sweep", "--admission", "reserve,on-demand", "--prefix-cache", "off,on", "--rates", "4",
                     "--pool-gib", "0.5", "--max-batch", "8", "--backend", "paged", "--n", "60", "--jobs", "1",
                     "--table", str(table), "--out", str(out))
    assert code == 0
    points = pd.read_csv(out / "sweep.csv")
    assert sorted(zip(points["admission"], points["prefix_cache"])) == [
        ("on-demand", False), ("on-demand", True), ("reserve", False), ("reserve", True)]
    assert points.loc[points["admission"] == "on-demand", "preemptions"].notna().all()
