"""scripts/candidate_terms.py: the candidate correction terms the README weighs, on synthetic steps and on a
committed validation's runs."""
import numpy as np
import pandas as pd
import pytest


def test_a_bucket_factor_is_its_share_of_its_size_class_and_the_temperature_slope_is_recovered(script):
    terms = script("candidate_terms")
    n = 40  # per bucket: at least costs.context.MIN_STEPS, so each bucket gets its own factor
    df = pd.DataFrame({"step_kind": "prefill", "bucket": [320] * n + [384] * n, "size": "t257-512",
                       "price": 1.0, "real": [1.10] * n + [1.00] * n})
    f = terms.bucket_factors(df)
    class_ratio = (1.10 * n + 1.00 * n) / (2 * n)
    assert f[320] == pytest.approx(1.10 / class_ratio) and f[384] == pytest.approx(1.00 / class_ratio)
    assert terms.bucket_factors(df.iloc[n - 5:]).get(320) == 1.0  # too few steps: no factor of its own
    t = np.linspace(45, 70, 200)
    steps = pd.DataFrame({"T": t, "price": 1.0, "real": np.exp(0.001 * (t - 55))})
    assert terms.slope(steps, 55.0) == pytest.approx(0.001)


def test_the_terms_are_weighed_on_a_committed_validation(script, capsys):
    assert script("candidate_terms").main(["results/calibration/t10/h200-t10-v15-71520d56.json",
                                           "results/validation-v16-71520d56/real"]) == 0
    out = capsys.readouterr().out
    assert "temperature, in sample: 6 runs with telemetry" in out
    assert "bucket, held out by point: each run's real / price - 1: RMS" in out and "of 6" in out
