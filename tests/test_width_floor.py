"""scripts/width_floor.py: how narrow a band with no error of its own is against the range of a point's repeats."""
import math

import numpy as np
import pytest
from scipy import stats

TABLE = "results/calibration/t10/h200-t10-v25.json"


def test_the_range_distribution_is_the_range_of_normal_draws(script):
    floor = script("width_floor")
    draws = np.random.default_rng(7).standard_normal((400_000, 3))
    ranges = draws.max(1) - draws.min(1)
    for r in (0.5, 1.645, 2.5):
        assert floor.range_cdf(r, 3) == pytest.approx((ranges <= r).mean(), abs=3e-3)
    assert floor.median_ratio(2.0, 3) == pytest.approx(2.0 / np.median(ranges), rel=5e-3)


def test_two_repeats_range_is_a_half_normal_times_root_two(script):
    floor = script("width_floor")
    z = stats.norm.ppf(0.95)
    # |X1 - X2| ~ sqrt(2) |N|: a 90% band of the run noise alone is within 2x where |X1 - X2| >= z
    assert floor.within_2x(2 * z, 2) == pytest.approx(2 * (1 - stats.norm.cdf(z / math.sqrt(2))), abs=1e-6)


def test_it_prints_each_number_of_repeats_and_refuses_bad_input_in_a_line(script, capsys):
    floor = script("width_floor")
    assert floor.main(["--table", TABLE, "--repeats", "3,10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [l for l in lines if l.strip()[:2] in ("3 ", "10")]
    assert len(rows) == 2 and "b3b9a428a43ce731" in lines[0]
    alone3, alone10 = (float(r.split("|")[1].split("%")[0]) for r in rows)
    assert alone3 < alone10  # more repeats, a wider real spread to hold the same band
    assert floor.main(["--table", TABLE, "--repeats", "1"]) == 2
    assert floor.main(["--table", "no-such-table.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("width_floor: error:") for e in err)
