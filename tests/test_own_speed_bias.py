"""scripts/own_speed_bias.py: the simulator against the engine at each run's own speed, on a committed validation."""
import shutil

TABLE = "results/calibration/t10/h200-t10-v25.json"
V = "results/validation-v26-b04010c1"


def _rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines()[1:]:
        if "|" not in line:  # the speed lines that follow the table
            continue
        head, *cells = line.split("|")
        load, policy, runs = head.split()
        rows[load, policy] = int(runs), [c.split(",") for c in cells]
    return rows


def test_every_complete_run_is_graded_at_its_own_speed_by_load_and_policy(script, capsys):
    bias = script("own_speed_bias")
    assert bias.main(["--table", TABLE, V]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["near", "all"][0] == 18 and ("past", "all") not in rows  # v26's 6 near points x 3, no past run
    assert sum(n for (load, policy), (n, _) in rows.items() if load == "near" and policy != "all") == 18
    served = rows["near", "all"][1][2]
    assert abs(float(served[0].rstrip("%"))) < 1.0  # at its own speed the served rate is the run's, to 1%


def test_sensitivity_turns_the_bias_into_the_speed_it_amounts_to(script, capsys):
    """Near capacity a slower engine waits longer: over v26's 18 runs TTFT p50 moves several percent per 1% of speed,
    and the line says the bias over that."""
    import re

    bias = script("own_speed_bias")
    assert bias.main(["--table", TABLE, "--sensitivity", V]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("near: steps while a request waits run"))
    sens, mean, speed = (float(x) for x in re.search(
        r"moves ([\d.]+)% per 1% of speed .* bias ([-+][\d.]+)% is ([-+][\d.]+)% of speed", line).groups())
    assert sens > 2 and abs(speed - mean / sens) < 0.01 + 0.01 * abs(speed)


def test_a_run_is_simulated_at_its_own_speed(script, capsys, tmp_path):
    """Steps recorded 10% longer (the requests' times as they were) make the run 10% slower to the table: simulated
    at that speed its TTFT p50 is longer, so measured over simulated falls."""
    import pandas as pd

    bias = script("own_speed_bias")
    v = tmp_path / "v"
    shutil.copytree(V, v, symlinks=False, ignore=shutil.ignore_patterns("*.png"))
    for run in sorted((v / "real").glob("*/run-*")):
        if run.parent.name != "packed-sharegpt-near-41" or run.name != "run-1":
            shutil.rmtree(run)
    assert bias.main(["--table", TABLE, str(v)]) == 0
    before = float(_rows(capsys.readouterr().out)["near", "all"][1][0][0].rstrip("%"))
    path = next((v / "real" / "packed-sharegpt-near-41" / "run-1").glob("steps.csv*"))
    steps = pd.read_csv(path)
    steps["end"] = steps.start + 1.1 * (steps.end - steps.start)
    steps.to_csv(path, index=False)
    assert bias.main(["--table", TABLE, str(v)]) == 0
    after = float(_rows(capsys.readouterr().out)["near", "all"][1][0][0].rstrip("%"))
    assert after < before - 5


def test_bad_input_is_one_line(script, capsys, tmp_path):
    bias = script("own_speed_bias")
    assert bias.main(["--table", "no-such.json", V]) == 2
    assert bias.main(["--table", TABLE, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("own_speed_bias: error:") for e in err)


def test_the_pass_end_before_a_prefill_is_measured_and_priced_on_the_prefill_step(script, capsys):
    """v26's runs: the decode step before a prefill step holds tenths of a ms over its price (the host's work at the
    pass's end, the device idle); priced on the prefill step instead, each run simulated again."""
    import re

    bias = script("own_speed_bias")
    assert bias.main(["--table", TABLE, "--before-prefill", V]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("near: the decode step before a prefill step holds"))
    held = dict((p, float(ms)) for p, ms in re.findall(r"(chunked|mixed|packed|padded) ([\d.]+)", line))
    assert set(held) == {"chunked", "mixed", "packed", "padded"} and all(0 < ms < 1 for ms in held.values())
    moved, alone = (float(x) for x in re.search(r"bias is ([-+][\d.]+)% \(at the run's speed alone ([-+][\d.]+)%",
                                                 line).groups())
    assert moved != alone


def test_a_model_with_the_pass_end_prices_a_prefill_after_a_decode_step_more_and_no_other(script):
    from servecap.costs.model import CostModel
    from servecap.costs.shapes import PrefillShape
    from servecap.sim.inputs import load_table

    bias = script("own_speed_bias")
    table = load_table(TABLE)
    base, more = CostModel(table), bias._PassEnd(table.raw, 0.001)
    shape = PrefillShape.of([512])
    for prev, idle, extra in (("decode", 0.0, 0.001), ("retired", 0.0, 0.001), ("prefill", 0.0, 0.0),
                              ("decode", 1.0, 0.0), (None, 0.0, 0.0)):
        got = more.prefill_in_context(shape, "padded", prev, idle) - base.prefill_in_context(shape, "padded", prev, idle)
        assert abs(got - extra) < 1e-12, (prev, idle)
