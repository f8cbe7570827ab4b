"""scripts/instance_spread.py: where fresh engines of one point differ, by the part of the run its steps are."""
import shutil
from pathlib import Path

import pandas as pd
import pytest

RUN = Path("results/validation-v16-71520d56/real/sharegpt-past-56/run-1")


def test_a_run_slower_only_right_after_its_prefills_is_found_slower_there_alone(tmp_path, script, capsys):
    spread = script("instance_spread")
    point = tmp_path / "v" / "real" / "p-1"
    fast, slow = point / "run-1", point / "run-2"
    shutil.copytree(RUN, fast)
    shutil.copytree(RUN, slow)
    steps = pd.read_csv(slow / "steps.csv.gz")
    after = (steps.kind == "decode") & (steps.kind.shift(1, fill_value="idle") != "decode")
    steps.loc[after, "end"] = steps.start + 1.1 * (steps.end - steps.start)
    steps.to_csv(slow / "steps.csv.gz", index=False)
    assert spread.main([str(tmp_path / "v")]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "p-1/run-2" in l)
    busy, inside, after_prefill, prefill = map(float, line.split()[1:])
    assert busy > 1.0
    assert (inside, prefill) == (1.0, 1.0)
    assert after_prefill == pytest.approx(1.1, abs=1e-3)


def test_no_point_with_repeats_is_a_one_line_error(tmp_path, script, capsys):
    shutil.copytree(RUN, tmp_path / "v" / "real" / "p-1" / "run-1")
    assert script("instance_spread").main([str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err.strip() == "no point with two or more runs"


def test_an_interrupted_run_is_no_repeat(tmp_path, script, capsys):
    import json
    point = tmp_path / "v" / "real" / "p-1"
    shutil.copytree(RUN, point / "run-1")
    shutil.copytree(RUN, point / "run-2")
    meta = json.loads((point / "run-2" / "meta.json").read_text())
    (point / "run-2" / "meta.json").write_text(json.dumps({**meta, "status": "running"}))  # killed mid-run
    assert script("instance_spread").main([str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err.strip() == "no point with two or more runs"
