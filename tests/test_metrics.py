"""Metrics on hand-made run records; every expected value is worked out by hand in the comments."""
import json
import math

import pytest

from servecap.traces import metrics
from servecap.traces.records import RunWriter

approx = pytest.approx


def prefill(w, step, rows, padded, real, start, end, group):
    w.add("steps", (step, "prefill", rows, padded, real, rows * padded, rows * padded ** 2, 0, 0, 0, start, end, group,
                    rows, 0, 0, 0, 0, 0))


def decode(w, step, rows, start, end, retired=0):
    w.add("steps", (step, "decode", rows, 0, 0, 0, 0, 0, 0, 0, start, end, -1, 0, retired, 0, 0, 0, 0))


def small_run():
    """4 requests, 2 admission groups, one obvious spike.

    Step 0 admits r0 alone (prompt 100) and prefills it 0.0-0.4; decode steps of 0.1 s follow. r1, r2, r3
    arrive at 0.3, 0.5, 0.7 and are admitted together at 0.8 (prompts 400, 50, 150), prefilled 0.8-1.6, so
    r0's gap between its tokens at 0.8 and 1.7 is 0.9 s against its 0.1 s baseline.
    """
    w = RunWriter(None, {"trace": {"rate": 2.0, "n": 4, "seed": 0, "kind": "poisson"}, "backend": "paged"})
    # request_id, arrival, admitted, admit_step, group_id, group_size, first_token, finished, prompt, output, blocks
    w.add("requests", (0, 0.0, 0.0, 0, 0, 1, 0.4, 1.9, 100, 8, 6, 0, 0, 0, 0))
    w.add("requests", (2, 0.5, 0.8, 4, 1, 3, 1.6, 1.6, 50, 1, 5, 0, 0, 0, 0))
    w.add("requests", (1, 0.3, 0.8, 4, 1, 3, 1.6, 1.9, 400, 4, 11, 0, 0, 0, 0))
    w.add("requests", (3, 0.7, 0.8, 4, 1, 3, 1.6, 2.1, 150, 6, 7, 0, 0, 0, 0))
    prefill(w, 0, 1, 100, 100, 0.0, 0.4, 0)
    for step, t in enumerate((0.4, 0.5, 0.6, 0.7)):
        decode(w, step, 1, t, t + 0.1)
    prefill(w, 4, 3, 400, 600, 0.8, 1.6, 1)
    decode(w, 4, 3, 1.6, 1.7)
    decode(w, 5, 3, 1.7, 1.8)
    decode(w, 6, 3, 1.8, 1.9, retired=2)
    decode(w, 7, 1, 1.9, 2.0)
    decode(w, 8, 1, 2.0, 2.1, retired=1)
    tokens = {0: (0.4, 0.5, 0.6, 0.7, 0.8, 1.7, 1.8, 1.9), 1: (1.6, 1.7, 1.8, 1.9), 2: (1.6,),
              3: (1.6, 1.7, 1.8, 1.9, 2.0, 2.1)}
    for rid, times in tokens.items():
        w.add_many("tokens", [(rid, i, t, -1) for i, t in enumerate(times)])
    return w.record()


def test_request_metrics():
    m = metrics.request_metrics(small_run())
    assert list(m["request_id"]) == [0, 1, 2, 3]  # arrival order, not the order rows were written
    assert list(m["queue_wait"]) == approx([0.0, 0.5, 0.3, 0.1])
    assert list(m["ttft"]) == approx([0.4, 1.3, 1.1, 0.9])
    assert list(m["sojourn"]) == approx([1.9, 1.6, 1.1, 1.4])
    tpot = list(m["tpot"])
    assert tpot[0] == approx((1.9 - 0.4) / 7) and tpot[1] == approx(0.3 / 3) and tpot[3] == approx(0.5 / 5)
    assert math.isnan(tpot[2])  # a single-token request has no TPOT


def test_summary_small_run():
    s = metrics.summary(small_run())
    assert s["n"] == 4
    assert s["served_rate"] == approx(4 / 2.1)  # 4 served over last finish 2.1 - first arrival 0.0
    # waits sorted [0, 0.1, 0.3, 0.5]: p50 (0.1 + 0.3) / 2; p95 at position 0.95 * 3 = 2.85 -> 0.3 + 0.85 * 0.2
    assert s["queue_wait_p50"] == approx(0.2) and s["queue_wait_p95"] == approx(0.47)
    # TTFT sorted [0.4, 0.9, 1.1, 1.3]: p50 1.0; p95 1.1 + 0.85 * 0.2
    assert s["ttft_p50"] == approx(1.0) and s["ttft_p95"] == approx(1.27)
    assert s["tpot_p50"] == approx(0.1)  # median of [0.1, 0.1, 0.214]; r2's NaN is left out
    # group sizes [1, 3]: p50 2, p95 1 + 0.95 * 2; waste [0, (3 * 400 - 600) / 600 = 1]: p50 0.5, p95 0.95
    assert (s["group_size_p50"], s["group_size_p95"], s["group_size_max"]) == approx((2.0, 2.9, 3.0))
    assert (s["padding_waste_p50"], s["padding_waste_p95"]) == approx((0.5, 0.95))
    assert s["wall_time_s"] == approx(2.1)
    assert s["decode_tok_s"] == approx(15 / 0.9)  # (7 + 3 + 0 + 5) decode tokens over 9 decode steps of 0.1 s
    # rate 2.0 comes from meta. expected = 4 / (0.7 - 0.0 + 1.9): the first 10% is r0 alone, sojourn 1.9.
    # Theil-Sen over (arrival, wait) (0, 0) (0.3, 0.5) (0.5, 0.3) (0.7, 0.1): pair slopes 5/3, 0.6, 1/7, -1, -1, -1;
    # median (-1 + 1/7) / 2 = -3/7, times the 0.7 s span = -0.3.
    assert s["rate"] == 2.0 and s["expected_rate"] == approx(4 / 2.6)
    assert s["trend_rise_s"] == approx(-0.3)
    assert s["served_ok"] and s["stable"]
    json.dumps(s)


def test_admission_groups_frame():
    g = metrics.admission_groups(small_run())["groups"]
    assert list(g["group_id"]) == [0, 1] and list(g["size"]) == [1, 3]
    assert list(g["padded_tokens"]) == [100, 1200]  # 1 x 100, 3 x 400
    assert list(g["waste"]) == approx([0.0, 1.0])
    assert list(g["start"]) == approx([0.0, 0.8])


def test_token_gaps():
    g = metrics.token_gaps(small_run())
    assert g["baseline_p50"] == approx(0.1)  # r0, r1, r3 all step 0.1 s; r2 has no gaps
    assert g["n_spikes"] == 1
    assert g["spike_gap_p50"] == approx(0.9) and g["spike_gap_max"] == approx(0.9)  # 1.7 - 0.8
    spike = g["spikes"].iloc[0]
    assert (spike["request_id"], spike["index"]) == (0, 5)
    assert spike["gap"] == approx(0.9) and spike["baseline"] == approx(0.1) and spike["time"] == approx(1.7)


def test_token_gaps_without_tokens():
    g = metrics.token_gaps(RunWriter(None, {}, tables=("requests", "steps")).record())
    assert g["n_spikes"] == 0 and g["spikes"].empty
    assert math.isnan(g["baseline_p50"]) and math.isnan(g["spike_gap_max"])


def test_closed_run():
    w = RunWriter(None, {})
    # 2 requests at t=0 in one group: prompts 16 and 48 padded to 48; prefill 0-1, then 3 decode steps of 0.5 s
    w.add("requests", (0, 0.0, 0.0, 0, 0, 2, 1.0, 2.0, 16, 3, 1, 0, 0, 0, 0))
    w.add("requests", (1, 0.0, 0.0, 0, 0, 2, 1.0, 2.5, 48, 4, 1, 0, 0, 0, 0))
    prefill(w, 0, 2, 48, 64, 0.0, 1.0, 0)
    decode(w, 0, 2, 1.0, 1.5)
    decode(w, 1, 2, 1.5, 2.0, retired=1)
    decode(w, 2, 1, 2.0, 2.5, retired=1)
    c = metrics.closed_run(w.record())
    assert c["wall_time_s"] == approx(2.5)
    assert c["decode_tok_s"] == approx((2 + 3) / 1.5)  # sum(output - 1) over 3 x 0.5 s of decode
    assert c["ttft_p50"] == approx(1.0)


def arrival_run(arrivals, waits, service):
    """Requests admitted `wait` after arriving and finished `service` after admission (first token at +0.1)."""
    w = RunWriter(None, {})
    for i, (a, q, s) in enumerate(zip(arrivals, waits, service)):
        w.add("requests", (i, a, a + q, i, i, 1, a + q + 0.1, a + q + s, 16, 10, 1, 0, 0, 0, 0))
    return w.record()


def test_stable_when_waits_stay_near_zero():
    rec = arrival_run(range(10), [0.01] * 10, [1.0] * 10)
    s = metrics.stability(rec, rate=1.0)
    # served 10 / (9 + 1.01); expected 10 / (9 + 1.01) with r0's sojourn 1.01; equal waits: slope 0
    assert s["served_rate"] == approx(10 / 10.01) and s["expected_rate"] == approx(10 / 10.01)
    assert s["trend_rise_s"] == approx(0.0)
    assert s["rate"] == 1.0 and s["served_ok"] and not s["trending"] and s["stable"]


def test_unstable_when_waits_grow_linearly():
    rec = arrival_run(range(10), [0.5 * a for a in range(10)], [1.0] * 10)
    s = metrics.stability(rec, rate=1.0)
    # last finish 9 + 4.5 + 1 = 14.5; expected 10 / (9 + 1); wait slope 0.5 over a 9 s span
    assert s["served_rate"] == approx(10 / 14.5) and s["expected_rate"] == approx(1.0)
    assert s["trend_rise_s"] == approx(4.5)
    assert s["trending"] and not s["served_ok"] and not s["stable"]
    assert not metrics.stability(rec, rate=1.0, rise_tol_s=5.0)["trending"]


def test_trend_alone_makes_unstable():
    # 20 requests, waits 0.1 per second of arrival; the first 10% (r0, r1) are slow to serve: 3.0 and 5.0 s
    rec = arrival_run(range(20), [0.1 * a for a in range(20)], [3.0, 5.0] + [1.0] * 18)
    s = metrics.stability(rec)
    # expected 20 / (19 + median(3.0, 0.1 + 5.0) = 4.05); served 20 / (19 + 1.9 + 1); rise 0.1 x 19
    assert s["expected_rate"] == approx(20 / 23.05) and s["served_rate"] == approx(20 / 21.9)
    assert s["trend_rise_s"] == approx(1.9)
    assert s["rate"] is None and s["served_ok"] and s["trending"] and not s["stable"]


def test_unstable_when_served_rate_is_ten_percent_short():
    rec = arrival_run(range(9), [0.0] * 9, [1.0] * 8 + [2.0])
    s = metrics.stability(rec, rate=1.0)
    # expected 9 / (8 + 1); served 9 / (8 + 2) = 0.9 < 0.97; waits flat
    assert s["expected_rate"] == approx(1.0) and s["served_rate"] == approx(0.9)
    assert s["trend_rise_s"] == approx(0.0)
    assert not s["served_ok"] and not s["trending"] and not s["stable"]


def test_capacity_bracket():
    assert metrics.capacity_bracket([(4, False), (1, True), (7, False), (3, True), (2, True)]) == (3.0, 4.0)
    # a stable point past the first unstable rate does not move the bracket
    assert metrics.capacity_bracket([(5, True), (2, True), (3, False)]) == (2.0, 3.0)
    assert metrics.capacity_bracket([(2, True), (1, True)]) == (2.0, None)
    assert metrics.capacity_bracket([(3, False), (2, False)]) == (None, 2.0)
    assert metrics.capacity_bracket([]) == (None, None)


def test_empty_run():
    rec = RunWriter(None, {"trace": {"rate": 3.0}}).record()
    s = metrics.summary(rec)
    assert s["n"] == 0
    for k in ("served_rate", "queue_wait_p50", "ttft_p95", "tpot_p50", "group_size_max", "padding_waste_p50",
              "wall_time_s", "decode_tok_s", "trend_rise_s", "expected_rate"):
        assert math.isnan(s[k]), k
    assert s["rate"] == 3.0 and not s["stable"]
    assert metrics.token_gaps(rec)["n_spikes"] == 0
    json.dumps(s)


def test_theil_sen_slope_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    import numpy as np
    rng = np.random.default_rng(0)
    for n in (3, 7, 300):
        x = np.sort(rng.uniform(0, 10, n))
        x[n // 2] = x[n // 2 - 1]  # a tie in x: that pair has no slope
        y = rng.normal(size=n) + 0.3 * x
        assert metrics.theil_sen_slope(x, y) == stats.theilslopes(y, x).slope
