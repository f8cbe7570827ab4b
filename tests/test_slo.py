"""SLOs: how they are written, and goodput, attainment and the SLO verdict on hand-made and real run records."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_metrics import small_run

from servecap.traces import metrics
from servecap.traces.errors import InputError
from servecap.traces.records import RunWriter, read_run
from servecap.traces.slo import SLO, describe, parse_slos

REPO = Path(__file__).resolve().parents[1]


def test_slos_are_written_as_vllm_names_them():
    slos = parse_slos("ttft_p99=2,tpot_p99=0.05,e2e_p99=20")
    assert slos == (SLO("ttft", 2.0, 99.0), SLO("tpot", 0.05, 99.0), SLO("e2el", 20.0, 99.0))
    assert [s.name for s in slos] == ["ttft_p99", "tpot_p99", "e2el_p99"]
    assert [s.column for s in slos] == ["ttft", "tpot", "sojourn"]
    assert parse_slos(" TTFT = 1.5 , e2el_p99.9=3") == (SLO("ttft", 1.5), SLO("e2el", 3.0, 99.9))
    assert describe(slos[:2]) == "ttft <= 2000 ms (and its p99), tpot <= 50 ms (and its p99)"
    assert str(slos[2]) == "e2el_p99=20"


@pytest.mark.parametrize("text, message", [
    ("ttft", "'ttft' is not an SLO: write NAME[_pNN]=SECONDS"),
    ("ttft_x=1", "'ttft_x=1' is not an SLO"),
    ("latency=2", "'latency=2': unknown SLO metric 'latency'"),
    ("ttft=abc", "'ttft=abc': the limit must be a positive number of seconds"),
    ("ttft=-1", "'ttft=-1': the limit must be a positive number of seconds"),
    ("ttft=inf", "'ttft=inf': the limit must be a positive number of seconds"),
    ("ttft_p0=1", "'ttft_p0=1': the percentile must be above 0 and at most 100"),
    ("ttft_p101=1", "'ttft_p101=1': the percentile must be above 0 and at most 100"),
    ("ttft=1,ttft_p99=2", "more than one SLO for ttft"),
    (" , ", "no SLO given"),
])
def test_malformed_slos_are_refused_in_one_line(text, message):
    with pytest.raises(InputError) as e:
        parse_slos(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_goodput_and_attainment_by_hand():
    # small_run: TTFT [0.4, 1.3, 1.1, 0.9], TPOT [1.5/7, 0.1, none (one token), 0.1], over 2.1 s (arrival 0 to the
    # last finish). ttft <= 1: r0, r3; tpot <= 0.15: r1, r2 (no TPOT: nothing to be late), r3. Both: r3 alone.
    s = metrics.summary(small_run(), slos=parse_slos("ttft_p50=1,tpot=0.15"))
    assert s["attain_ttft"] == 0.5 and s["attain_tpot"] == 0.75
    assert s["goodput"] == 1 / 2.1 and s["good_fraction"] == 0.25
    assert s["ttft_p50"] == 1.0  # (0.9 + 1.1) / 2: the tail is within its limit, the goodput is not
    assert not s["slo_ok"]  # the rate (2.0) is in the record's meta
    # Limits every request meets: goodput is the served rate, and the verdict is the stability check's served_ok
    # (4 / 2.1 served against 4 / 2.6 expected).
    s = metrics.summary(small_run(), slos=parse_slos("ttft_p99=2,e2e=2"))
    assert s["goodput"] == s["served_rate"] and s["good_fraction"] == 1.0 and s["attain_e2el"] == 1.0
    assert s["served_ok"] and s["slo_ok"]


def test_without_a_rate_there_is_no_slo_verdict():
    rec = small_run()
    rec.meta.pop("trace")
    s = metrics.summary(rec, slos=parse_slos("ttft=2"))
    assert s["goodput"] == 4 / 2.1 and "slo_ok" not in s and "stable" not in s


def _tail_run(outlier_ttft: float):
    """100 requests 0.1 s apart, each admitted on arrival, first token after 0.01 s, done 0.1 s later; r0's first
    token comes after `outlier_ttft` instead (it finishes well before the last request, so the span is 10.01 s)."""
    w = RunWriter(None, {"trace": {"rate": 10.0}})
    for i in range(100):
        a = i / 10
        ttft = outlier_ttft if i == 0 else 0.01
        w.add("requests", (i, a, a, i, i, 1, a + ttft, a + ttft + 0.1, 16, 2, 1, 0, 0, 0, 0))
    return w.record()


def test_a_tail_objective_can_fail_where_goodput_holds():
    # One request in 100 over the limit: 99% good, as the goodput rule allows. Its TTFT of 5 s drags the linear
    # p99 (position 0.99 x 99 = 98.01 in the sorted TTFTs) to 0.01 + 0.01 x (5 - 0.01) = 0.0599 > 0.05.
    rec = _tail_run(5.0)
    per_request = metrics.summary(rec, slos=parse_slos("ttft=0.05"))
    assert per_request["good_fraction"] == 0.99 and per_request["served_ok"] and per_request["slo_ok"]
    with_tail = metrics.summary(rec, slos=parse_slos("ttft_p99=0.05"))
    assert with_tail["ttft_p99"] == pytest.approx(0.0599, rel=0, abs=1e-12)
    assert with_tail["good_fraction"] == 0.99 and not with_tail["slo_ok"]
    # Two over the limit: 98% good, refused by the goodput rule alone.
    assert metrics.summary(_tail_run(0.06), slos=parse_slos("ttft=0.05"))["slo_ok"]
    rec = _tail_run(0.06)
    rec.requests.loc[1, "first_token"] += 0.05
    assert not metrics.summary(rec, slos=parse_slos("ttft=0.05"))["slo_ok"]


def test_an_empty_run_meets_no_slo():
    s = metrics.summary(RunWriter(None, {"trace": {"rate": 3.0}}).record(), slos=parse_slos("ttft_p99=1"))
    assert math.isnan(s["goodput"]) and math.isnan(s["attain_ttft"]) and math.isnan(s["ttft_p99"])
    assert s["slo_ok"] is False


def test_a_real_run_scores_with_the_same_functions():
    rec = read_run(REPO / "results/wave1/validation/real/rate-33/run-1")
    assert rec.meta["kind"] == "engine"
    slos = parse_slos("ttft_p99=0.5,tpot_p99=0.01")
    s = metrics.summary(rec, slos=slos)
    served = rec.requests[rec.requests["finished"].notna()]
    ttft = served["first_token"] - served["arrival"]
    tpot = (served["finished"] - served["first_token"]) / (served["output_tokens"] - 1)
    good = ((ttft <= 0.5) & ~(tpot > 0.01)).sum()
    assert s["goodput"] == good / (served["finished"].max() - served["arrival"].min())
    assert s["attain_ttft"] == (ttft <= 0.5).mean() and s["good_fraction"] == good / len(served)
    assert "slo_ok" in s and s["slo_ok"] == (s["good_fraction"] >= 0.99 and s["served_ok"]
                                             and s["ttft_p99"] <= 0.5 and s["tpot_p99"] <= 0.01)
    # A record of one engine is one replica: its per-replica summary is its summary.
    per = metrics.per_replica(rec, slos=slos)
    assert len(per) == 1 and per.iloc[0].to_dict() == pytest.approx({"replica": 0, "share": 1.0, **s}, nan_ok=True)
