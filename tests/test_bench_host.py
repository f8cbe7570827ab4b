"""scripts/bench_host.py: the host work the device waits for, measured side by side with another checkout."""
import re


def test_a_tree_against_itself_makes_the_same_steps_and_reports_each_measures_ratio(script, capsys):
    bench = script("bench_host")
    trace = "results/validation-v24/traces/packed-sharegpt-near.csv:packed"
    assert bench.main([str(bench.HERE), "--rounds", "1", "--trace", trace]) == 0
    out = capsys.readouterr()
    assert "different steps" not in out.err
    runs = re.findall(r"the device waited ([\d.]+) s for the host \(\d+ us a step\) of its ([\d.]+) s", out.out)
    assert len(runs) == 2 and all(0 < float(idle) < float(host) for idle, host in runs)
    summary = out.out.strip().splitlines()[-1]
    assert summary.startswith("packed-sharegpt-near packed, this / other: idle_s ")
    assert all(m in summary for m in ("idle_s", "host_s", "launch_s"))
