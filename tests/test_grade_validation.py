"""scripts/grade_validation.py on a committed validation: the README's targets, each run's line, and --by; and
scripts/rebanded.py's re-planned bands."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def test_grading_a_validation_prints_its_targets_each_run_and_its_steps_by_a_context(capsys, script):
    assert script("grade_validation").main(["results/validation-v16-71520d56", "--by", "tokens"]) == 0
    out = capsys.readouterr().out.splitlines()
    # as committed in that validation's grade.txt (the README's table)
    assert "  sharegpt-past-56                   served +0.9%  TTFT p50 -4.9% (spread 8%) ok" in out
    runs = [line for line in out if "/run-" in line]
    assert len(runs) == 6 and all("SM clock" in line and " W (medians)" in line for line in runs)
    summary = next(line for line in out if "each run's summed step time" in line)
    lo, hi = (float(x) for x in summary.split(": ")[1].split(",")[0].split("-"))
    ratios = [float(line.split(": ")[1].split()[0]) for line in runs]
    assert (min(ratios), max(ratios)) == (lo, hi) == (0.998, 1.010)  # the summary is the runs' own range
    binned = out[out.index("  summed real / price in context by tokens, every run:") + 1:]
    assert binned and all(line.split()[0] == "prefill" for line in binned)  # positions bin prefill steps alone
    assert sum(int(line.split("n=")[1].split()[0]) for line in binned) == 1101 + 3028  # every prefill step, once


def test_one_validations_grade_gives_its_bands_by_load_as_pooling_it_alone_would(capsys, script):
    grade = script("grade_validation")
    v = Path("results/validation-v16-71520d56")
    runs, bands = grade.grade(v)[:2]
    by_load = ("  90% bands, near points", "  90% bands, past points")
    own = [line for line in capsys.readouterr().out.splitlines() if line.startswith(by_load)]
    assert own == ["  90% bands, past points: 42 of 42 inside (100.0%); width within 2x the repeats' spread 0 of 14 "
                   "(median 5.9x)"]  # only past-capacity points in that plan
    assert own == [line for line in grade.pooled({v: runs}, {v: bands}).splitlines() if line.startswith(by_load)]


@pytest.mark.parametrize("name, args", [("grade_validation", []), ("rebanded", ["--rule", "held"]),
                                        ("refresh_retro", ["--apply", "decode"]), ("refresh_retro", ["--readings"])])
def test_grading_refuses_a_directory_without_a_plan_in_one_line(capsys, tmp_path, script, name, args):
    assert script(name).main([*args, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no plan.json" in err


def test_grading_refuses_a_plan_without_runs_in_one_line(capsys, tmp_path, script):
    plan = Path("results/validation-v16-71520d56/plan.json")
    (tmp_path / "plan.json").write_text(plan.read_text())
    assert script("grade_validation").main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no complete real runs" in err


def test_a_runs_segments_price_the_steps_that_start_in_each_share_of_its_time(script):
    grade = script("grade_validation")
    start = pd.Series(range(101), dtype=float)  # 0..100 s: segments [0, 10), [10, 25), [25, 50), [50, 100]
    factor = pd.cut(start, [-1, 9.5, 24.5, 49.5, 101], labels=False).map({0: 1.3, 1: 1.2, 2: 1.1, 3: 1.0})
    steps = pd.DataFrame({"start": start, "price": 0.01, "real_s": 0.01 * factor})
    assert grade.by_segment(steps) == pytest.approx([1.3, 1.2, 1.1, 1.0])


def test_the_busy_share_counts_the_steps_time_in_the_window_before_each_time(script):
    busy_share = script("grade_validation").busy_share
    steps = pd.DataFrame({"replica": [0, 0, 0, 1], "start": [0.0, 0.3, 0.6, 0.0], "end": [0.2, 0.5, 0.7, 1.0]})
    at = [0.6, 0.6, 0.25, 0.0, 1.0, 0.4]
    replica = [0, 1, 0, 0, 1, 0]
    # at 0.6 on replica 0: [0.1, 0.2] and [0.3, 0.5] of the window [0.1, 0.6]; replica 1 was busy throughout;
    # at 0.25 the window reaches before the run; at 0.0 nothing has run; at 0.4, inside a step, its part up to then
    # (0.2 + 0.1)
    assert busy_share(steps, at, replica, window=0.5) == pytest.approx([0.6, 1.0, 0.4, 0.0, 1.0, 0.6])


def test_several_validations_pool_runs_error_speeds_spread_decode_by_policy_and_bands_by_load(script):
    import math
    import pandas as pd
    pooled = script("grade_validation").pooled
    runs = {"a": pd.DataFrame({"point": ["p1", "p2", "p4"], "policy": ["padded", "mixed", "padded"],
                               "load": ["near", "near", None], "total": [1.01, 0.99, 1.0],
                               "decode": [1.00, 0.98, np.nan], "prefill": [1.02, 0.97, 1.04]}),
            "b": pd.DataFrame({"point": ["p3"], "policy": ["padded"], "load": ["near"], "total": [1.02],
                               "decode": [1.03], "prefill": [np.nan]})}
    logs = [math.log(x) for x in (1.01, 0.99, 1.0, 1.02)]
    rms = math.sqrt(sum(x * x for x in logs) / 4)
    sd = abs(math.log(1.02) - sum(logs[:3]) / 3) / math.sqrt(2)
    told = math.sqrt(sum((logs[i] - (sum(logs[:3]) - logs[i]) / 2) ** 2 for i in range(3)) / 3)
    by_policy = math.sqrt(((logs[0] - logs[2]) ** 2 + (logs[2] - logs[0]) ** 2) / 2)
    assert pooled(runs).splitlines() == [
        f"over 2 validations: every run's summed step time real / price in context, RMS of the log {rms:.2%} (4 runs); "
        f"the validations' mean log speeds: sd {sd:.2%}",
        f"  a point's mean speed told by the other points of its validation: RMS of the log error {told:.2%} (3 "
        f"points); by those of its policy alone {by_policy:.2%} (2 points); by none (1.000) {rms:.2%} (4 points)",
        "  decode steps' real / price, mixed    near     1 runs: mean 0.9800, median 0.9800, 0.980-0.980",
        "  decode steps' real / price, padded   near     2 runs: mean 1.0150, median 1.0150, 1.000-1.030",
        "  each validation's prompt steps (prefill, chunk, fused) real / price, its runs' mean by policy: a GPU's own "
        "prefill speed",
        f"    {'':34s}    mixed   padded",
        f"    {'a':34s}    0.970    1.030",  # a run without decode steps still counts its prompt steps
        f"    {'b':34s}        -        -",
        "  decode and prompt steps' mean speeds by validation: 1 with both, too few to spread"]
    near = {"inside": 5, "graded": 6, "width_vs_real_spread": [{"width": 3.0, "real_spread": 1.0}]}
    past = {"inside": 2, "graded": 2, "width_vs_real_spread": [{"width": 1.0, "real_spread": 1.0}]}
    bands = {"a": {"all": {"inside": 7, "graded": 8, "width_vs_real_spread": []}, "near": near, "past": past},
             "b": {"all": near, "near": near, "past": {"inside": 0, "graded": 0, "width_vs_real_spread": []}}}
    assert pooled(runs, bands).splitlines()[9:] == [
        "  90% bands, all points: 12 of 14 inside (85.7%); width within 2x the repeats' spread 0 of 1 (median 3.0x)",
        "  90% bands, near points: 10 of 12 inside (83.3%); width within 2x the repeats' spread 0 of 2 (median 3.0x)",
        "  90% bands, past points: 2 of 2 inside (100.0%); width within 2x the repeats' spread 1 of 1 (median 1.0x)"]


def test_the_targets_sum_over_validations_and_count_each_validations_kinds_on_unrounded_medians(script):
    grade = script("grade_validation")

    def graded(targets, totals, kinds):
        return grade.Graded(pd.DataFrame({"total": totals}), {}, ([], {}), targets, kinds)
    a = graded([("p1", 0.019, 0.05, 0.0, True), ("p2", -0.021, -0.12, 0.0, False)], [1.019, 0.979, 1.0],
               {"decode": 1.0199, "prefill": 1.0201})  # 1.020 both, rounded: one is within 2%, one is not
    b = graded([("p1", 0.0, 0.15, 0.2, True)], [1.0], {"decode": 0.97})
    assert grade.targets_line({"a": a, "b": b}) == (
        "targets over 2 validations: 3 arrival points, served within 2% 2, TTFT p50 within max(10%, spread) 2; runs "
        "within 2% 3 of 4; step kinds within 2% 1 of 3")


def test_gpus_whose_decode_and_prompt_speeds_stray_apart_show_as_a_negative_correlation(script):
    together = script("grade_validation")._kinds_together

    def gpu(decode, prefill):  # two runs, their mean log speeds those given
        return pd.DataFrame({"decode": np.exp([decode - 0.01, decode + 0.01]), "prefill": np.exp([prefill] * 2)})
    apart = {"a": gpu(-0.02, 0.02), "b": gpu(0.0, 0.0), "c": gpu(0.02, -0.02)}
    assert together(apart) == ("  decode and prompt steps' mean log speeds over 3 validations: sd 2.00% and 2.00%, "
                               "correlation -1.00")
    assert together({**apart, "c": gpu(0.02, 0.02)}).endswith("correlation +0.00")


def test_a_band_run_on_several_gpus_is_held_to_the_spread_of_all_their_runs_and_only_where_it_is_one_band(script):
    from types import SimpleNamespace

    from servecap.validate.comparison import Compared
    across_gpus = script("grade_validation").across_gpus

    def at(pid, load, *ttft):
        return Compared(SimpleNamespace(id=pid, load=load), None, {}, [{"ttft_p50": t} for t in ttft])
    band = {"ttft_p50": {"lo": 0.1, "hi": 0.3, "median": 0.2}}
    wide = {"ttft_p50": {"lo": 0.0, "hi": 1.0, "median": 0.5}}
    a = ([at("p", "near", 0.15, 0.16), at("q", "near", 0.1, 0.2), at("r", "near", 0.1, 0.2), at("s", "past", 0.5, 0.5)],
         {"p": band, "q": band, "r": band, "s": wide})
    b = ([at("p", "near", 0.25, 0.26), at("r", "near", 0.1, 0.3), at("s", "past", 0.6)],
         {"p": band, "r": wide, "s": wide})  # r under another band: another plan's point of the same id
    assert across_gpus({"a": a, "b": b}) == [
        "  90% bands, near points run on several GPUs (1): width within 2x the spread of every GPU's runs 1 of 1 "
        "(median 1.8x)",
        "  90% bands, past points run on several GPUs (1): width within 2x the spread of every GPU's runs 0 of 1 "
        "(median 10.0x)"]
    assert across_gpus({"a": a}) == []


def test_a_points_speed_is_told_by_its_sessions_other_points_and_by_those_of_its_policy(script):
    import math
    import pandas as pd
    guessed = script("grade_validation")._guessed_speeds
    # session a: two padded points (p1 of two runs) and one packed; session b: one point, told by nothing
    a = pd.DataFrame({"point": ["p1", "p1", "p2", "p3"], "policy": ["padded", "padded", "padded", "packed"],
                      "total": [1.00, 1.04, 0.98, 1.01]})
    b = pd.DataFrame({"point": ["q"], "policy": ["padded"], "total": [0.97]})
    p1, p2, p3, q = (math.log(1.00) + math.log(1.04)) / 2, math.log(0.98), math.log(1.01), math.log(0.97)
    session = [p1 - (p2 + p3) / 2, p2 - (p1 + p3) / 2, p3 - (p1 + p2) / 2]
    policy = [p1 - p2, p2 - p1]
    rms = lambda v: math.sqrt(sum(x * x for x in v) / len(v))  # noqa: E731
    assert guessed({"a": a, "b": b}) == (
        f"  a point's mean speed told by the other points of its validation: RMS of the log error {rms(session):.2%} "
        f"(3 points); by those of its policy alone {rms(policy):.2%} (2 points); by none (1.000) "
        f"{rms([p1, p2, p3, q]):.2%} (4 points)")


def test_a_points_speed_is_told_by_the_first_points_run_on_its_gpu(script):
    import math
    import pandas as pd
    read_first = script("grade_validation")._read_first
    # p1 and p2 ran first (p2's first run before p3's), p3 later; session b has too few points to be told
    a = pd.DataFrame({"point": ["p1", "p1", "p2", "p3", "p3"], "policy": ["padded"] * 5,
                      "total": [1.00, 1.02, 0.99, 1.03, 1.01],
                      "started": ["t1", "t5", "t2", "t3", "t4"]})
    b = pd.DataFrame({"point": ["q", "r"], "policy": ["padded"] * 2, "total": [0.97, 1.0], "started": ["t1", "t2"]})
    read = (math.log(1.00) + math.log(1.02) + math.log(0.99)) / 3
    p3 = (math.log(1.03) + math.log(1.01)) / 2 - read
    assert read_first({"a": a, "b": b}) == (
        f"  a point's mean speed told by the first 2 points run on its GPU (their runs' mean): RMS of the log error "
        f"{abs(p3):.2%} (1 points)")
    assert read_first({"b": b}).endswith("RMS of the log error -")


def test_rebanding_with_the_gpu_spread_held_in_the_held_out_term_narrows_the_bands(capsys, tmp_path, script):
    rebanded = script("rebanded")
    v = "results/validation-v16-71520d56"  # planned from T10-v15, whose held-out runs ran on v11-v15's GPUs
    copy = rebanded.with_gpu_count(rebanded.plan_table(Path(v)), tmp_path / "t.json")
    assert json.loads(copy.read_text())["correction"]["held_out_gpus"]["n"] == 8
    counts = {}
    for rule in ("held", "added"):
        assert rebanded.main(["--rule", rule, v, "--work", str(tmp_path)]) == 0
        line = capsys.readouterr().out.splitlines()[0]
        inside, graded = int(line.split(": ")[1].split()[0]), int(line.split(" of ")[1].split()[0])
        counts[rule] = (inside, graded)
    assert counts["held"][1] == counts["added"][1] == 42  # 2 points x 3 runs x 7 metrics
    assert counts["held"][0] <= counts["added"][0]  # narrower bands hold no more


def test_copies_of_one_plan_are_rebanded_once_per_point_and_graded_as_each_alone(capsys, tmp_path, script, monkeypatch):
    rebanded = script("rebanded")
    copies = ["results/validation-v39-24c9ce4e", "results/validation-v39-7474a88c"]  # v39's plan, 3 points each
    alone = []
    for v in copies:
        assert rebanded.main(["--rule", "held", v, "--work", str(tmp_path)]) == 0
        alone.append(capsys.readouterr().out.splitlines()[0])
    banded = []
    point_band = rebanded.point_band
    monkeypatch.setattr(rebanded, "point_band", lambda iv, table, p, root: banded.append(p.id) or point_band(
        iv, table, p, root))
    assert rebanded.main(["--rule", "held", *copies, "--work", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == alone
    ran = [{d.name for d in Path(v, "real").iterdir()} for v in copies]
    assert sorted(banded) == sorted(ran[0] | ran[1]) and ran[0] & ran[1]  # a point both ran is banded once


def test_rebanding_widens_by_the_noise_file_given(capsys, tmp_path, script):
    v = "results/validation-v18-b75ac2b2"  # 54 of its 63 measurements inside the frozen bands
    inside = {}
    for name, sigma in (("none", 0.0), ("wide", 1.0)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"schema": "run-to-run-noise", "groups": [], "pooled": {"arrival": {
            k: {"sigma": sigma} for k in ("served_rate", "queue_wait_p50", "queue_wait_p95", "ttft_p50", "ttft_p95",
                                          "tpot_p50", "wall_time_s")}}}))
        assert script("rebanded").main(["--rule", "held", v, "--work", str(tmp_path), "--noise", str(f)]) == 0
        line = capsys.readouterr().out.splitlines()[0]
        inside[name] = int(line.split(": ")[1].split()[0])
    assert inside["none"] < inside["wide"] == 63  # a log sd of 1.0 on every metric holds every measurement


def test_a_refresh_re_applied_in_full_reproduces_its_frozen_grades_and_unapplied_prices_as_the_unrefreshed_table(
        capsys, tmp_path, script):
    retro, grade = script("refresh_retro"), script("grade_validation")
    v = "results/validation-v16-71520d56"  # refreshed from T10-v15, validation-v16's plan table
    points = lambda out: [line for line in out if line.endswith((" ok", " MISS"))]  # noqa: E731
    runs = lambda out: [line.split(";")[0] for line in out if "/run-" in line]  # noqa: E731
    assert retro.main(["--apply", "all", v, "--work", str(tmp_path)]) == 0
    full = capsys.readouterr().out.splitlines()
    assert points(full) == points(Path(v, "grade.txt").read_text().splitlines()) and len(points(full)) == 2
    assert retro.main(["--apply", "none", v, "--work", str(tmp_path)]) == 0
    none = capsys.readouterr().out.splitlines()
    assert grade.main(["results/validation-v16"]) == 0  # the same runs, graded on the table the refresh started from
    unrefreshed = runs(capsys.readouterr().out.splitlines())
    assert runs(none) == unrefreshed and len(unrefreshed) == 6 and unrefreshed != runs(full)
    assert json.loads((tmp_path / "none" / "validation-v16-71520d56" / "plan.json").read_text())["table"]["id"] != \
        json.loads((tmp_path / "all" / "validation-v16-71520d56" / "plan.json").read_text())["table"]["id"]


def test_a_refreshs_readings_are_the_log_of_its_factors_where_a_kinds_steps_are_priced_by_one_factor(capsys, script):
    import math
    retro = script("refresh_retro")
    v = Path("results/validation-v16-71520d56")
    factors = json.loads(retro.plan_table(v).read_text())["refresh"]["factors"]
    read = retro.readings(v)
    assert read["decode"][0] == pytest.approx(math.log(factors["decode paged"]), abs=5e-4)
    assert read["prefill"][0] == pytest.approx(math.log(factors["prefill"]), abs=5e-4)


def test_a_reading_the_refresh_only_recorded_counts_and_its_source_is_the_table_its_command_names(script):
    import math
    retro = script("refresh_retro")
    v = Path("results/validation-v27-5a57657f")  # an H100's, refreshed from the H100 table, not validation-v27's
    raw = json.loads(retro.plan_table(v).read_text())
    assert "prefill" not in raw["refresh"]["applied"]  # the H100 table's own GPU name: recorded, not applied
    _, old = retro.tables(v)
    assert old.table_id == raw["refreshed_from"]["table_id"] != retro.load_cost_table(
        retro.plan_table(Path("results/validation-v27"))).table_id
    assert retro.readings(v)["prefill"][0] == pytest.approx(math.log(raw["refresh"]["factors"]["prefill"]), abs=5e-4)


def test_replanning_from_the_validations_own_table_reproduces_its_grades_and_another_table_moves_them(
        capsys, tmp_path, script):
    from servecap.validate.comparison import plan_table
    grade = script("grade_validation")
    v = "results/validation-v16-71520d56"
    points = lambda out: [line for line in out if line.endswith((" ok", " MISS"))]  # noqa: E731
    assert grade.main([v, "--replan", str(plan_table(Path(v))), "--work", str(tmp_path / "own")]) == 0
    own = capsys.readouterr().out.splitlines()
    assert points(own) == points(Path(v, "grade.txt").read_text().splitlines()) and len(points(own)) == 2
    assert grade.main([v, "--replan", "results/calibration/t10/h200-t10-v26.json", "--work", str(tmp_path)]) == 0
    other = capsys.readouterr().out.splitlines()
    assert points(other) != points(own) and "(table 8670d17e692cfa0c)" in other[0]
    assert json.loads((tmp_path / "validation-v16-71520d56" / "plan.json").read_text())["table"]["id"] == \
        "8670d17e692cfa0c"


def test_grading_against_the_unrefreshed_plan_takes_its_predictions_and_table_and_refuses_one_of_other_points(
        capsys, script):
    grade = script("grade_validation")
    v, static = "results/validation-v16-71520d56", "results/validation-v16"
    assert grade.main([v, "--against", static]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = json.loads(Path(static, "plan.json").read_text())
    assert f"(table {plan['table']['id']})" in out[0] and plan["table"]["id"] not in Path(v, "grade.txt").read_text()
    assert grade.main([v, "--against", "results/validation-v32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not plan 2 of results/validation-v16-71520d56's points" in err


def test_unrefreshed_grades_a_refreshed_session_against_the_plan_its_points_came_from_and_others_as_they_are(
        capsys, tmp_path, script):
    grade = script("grade_validation")
    refreshed = "results/validation-v16-71520d56"
    assert grade.unrefreshed(Path(refreshed)) == grade.against(Path(refreshed), Path("results/validation-v16"))
    assert grade.unrefreshed(Path("results/validation-v39-91f89b91")) is None  # v39's table, as it is
    assert grade.main([refreshed, "--unrefreshed"]) == 0
    by_flag = capsys.readouterr().out
    assert grade.main([refreshed, "--against", "results/validation-v16"]) == 0
    assert by_flag == capsys.readouterr().out
    lost = tmp_path / "v"  # a refreshed session whose plan no longer says where its points came from
    lost.mkdir()
    plan = json.loads(Path(refreshed, "plan.json").read_text())
    (lost / "plan.json").write_text(json.dumps({**plan, "points_from": None}))
    assert grade.main([str(lost), "--unrefreshed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no plan of its points from that table is recorded" in err
    with pytest.raises(SystemExit) as bad:
        grade.main([refreshed, "--unrefreshed", "--against", "results/validation-v16"])
    assert bad.value.code == 2


def test_rebanded_one_factor_keeps_the_whole_runs_sigma_and_draws_no_kind_apart(script, tmp_path):
    from servecap.sim.inputs import load_table
    from servecap.sim.intervals import cost_sigma
    noise = {"schema": "run-to-run-noise", "pooled": {}, "groups": []}
    table = Path("results/calibration/h100/h100-t10-v29.json")
    by_kind = cost_sigma(load_table(table), noise)
    one = cost_sigma(load_table(script("rebanded").one_factor(table, tmp_path / "one.json")), noise)
    assert len(by_kind["kinds"]) == 8 and one["kinds"] == {} and one["sigma"] == pytest.approx(by_kind["sigma"])
