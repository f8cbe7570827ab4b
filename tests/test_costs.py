"""The costs package: cost tables (format, checks, versions), step shapes and the cost model's pricing."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from servecap.costs.model import CostModel, tile_work
from servecap.costs.shapes import DecodeShape, PrefillShape
from servecap.costs.synthetic import linear_table
from servecap.costs.table import load_cost_table, save_cost_table


def test_cost_table_round_trips(tmp_path):
    table = linear_table()
    tid = save_cost_table(table, tmp_path / "cost.json")
    loaded = load_cost_table(tmp_path / "cost.json")
    assert loaded.table_id == tid
    assert {k: v for k, v in loaded.raw.items() if k not in ("schema", "version", "table_id")} == \
        {k: v for k, v in table.items() if k not in ("schema", "version", "table_id")}


def test_shapes_of_a_padded_group_a_packed_one_and_a_chunk():
    s = PrefillShape.padded(3, 100)
    assert (s.rows, s.tokens, s.attn, s.span) == (3, 300, 30000, 100)
    s = PrefillShape.of([100, 20, 5])
    assert (s.rows, s.tokens, s.attn) == (3, 125, 100 ** 2 + 20 ** 2 + 5 ** 2)
    # A chunk of 512 positions after 1024 in the pool: each attends to the prefix and the chunk up to itself.
    assert PrefillShape.of([512], [1024]).attn == 512 * (512 + 2 * 1024)
    assert DecodeShape(4, 100, 40).after(3) == DecodeShape(4, 112, 43)


def test_tile_work_counts_whole_query_tiles_as_the_kernel_runs_them():
    # 256 positions in two 128-query tiles: the first reads 128 keys, the second 256; doubled as PrefillShape.attn.
    assert tile_work(256, 0, 128) == 2 * 128 * (128 + 256)
    assert tile_work(1, 0, 128) == 2 * 128 * 1  # one tile of 128 rows over a single key
    assert tile_work(512, 1024, 128) == 2 * 128 * sum(1024 + 128 * (j + 1) for j in range(4))
    # Large prompts approach the causal square plus one tile's worth per position.
    assert tile_work(4096, 0, 128) == 4096 ** 2 + 4096 * 128


def test_a_table_with_the_engines_rounding_prices_the_bucket_it_runs_at():
    raw = linear_table()
    buckets = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    rounded = CostModel({**raw, "engine": {"prefill_buckets": buckets, "prefill_block_m": 128}})
    plain = CostModel(raw)
    # 300 tokens run in the 512 bucket: the model prices the bucket (plus the padding's own attention), not 300.
    shape = PrefillShape.padded(3, 100)
    assert rounded.rounding.features(shape)[0] == 512 and plain.rounding.features(shape) == (300, 100.0)
    assert rounded.prefill(shape) > plain.prefill(shape)
    assert rounded.prefill(PrefillShape.padded(4, 128)) == rounded.prefill(PrefillShape.padded(4, 128))
    # the bucket a step runs at, one or many (a record's steps); past the last bucket, or unrecorded, the step itself
    tokens = np.array([1, 64, 65, 300, 131072, 200000])
    assert rounded.rounding.bucket(tokens).tolist() == [64, 64, 128, 512, 131072, 200000]
    assert [rounded.rounding.bucket(int(t)) for t in tokens] == [64, 64, 128, 512, 131072, 200000]
    assert plain.rounding.bucket(tokens).tolist() == tokens.tolist() and plain.rounding.bucket(300) == 300


def test_the_simulator_side_imports_no_torch_and_no_scipy():
    code = ("import sys, servecap.costs.model, servecap.costs.table, servecap.costs.shapes, servecap.sim.simulator, "
            "servecap.sim.cli, servecap.sim.sweep; "
            "sys.exit(('torch' in sys.modules) or ('scipy.optimize' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_decode_past_the_longest_measured_length_never_falls():
    """Knots whose last segment falls (noise) must not price a long decode step below a shorter one: past the
    measured lengths a step grows at least by its rows' K/V reads (a long-context run measured 19.6x and negative
    real / model before: results/long-shapes)."""
    import warnings

    from servecap.costs.model import ExtrapolationWarning
    cost = CostModel(linear_table())
    fit = cost._fit("paged")
    for knots in fit.knots:
        knots.y[-1] = knots.y[-2] - 1e-3 * (knots.x[-1] - knots.x[-2]) * 1e-3  # falling: -1 us a token
        knots._at.clear()
    top = int(fit.top)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        steps = [cost.decode("paged", 4, 4 * n, n) for n in (top, 2 * top, 8 * top)]
    assert steps[0] < steps[1] < steps[2]


def test_knots_without_a_floor_extrapolate_their_end_segment_without_a_numpy_warning():
    """A floor that starts nowhere (floor_from inf, the default) leaves the end segment's slope as it is; its
    unused branch once computed inf - inf and warned on every refresh."""
    import warnings

    from servecap.costs.model import _interp
    x, y = np.array([1.0, 2.0]), np.array([1.0, 1.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _interp(x, y, np.array([4.0]), min_slope=1.0).tolist() == [2.5]
        assert _interp(x, y, np.array([4.0]), min_slope=1.0, floor_from=3.0).tolist() == [3.0]


def test_where_fused_steps_were_measured_a_step_also_pays_for_its_longest_attention_program():
    """Points whose cost grows 8e-7 s a key of the step's longest sequence context (its critical path: a fused
    step's decode rows are one-query tiles over long prefixes, run all at once) beside chunks and whole prompts:
    the fit recovers that term where fused steps are among the points, and a table without them keeps the older
    form."""
    from servecap.costs.fit import fit_prefill
    from servecap.costs.table import PATH_PARAM, PREFIX_PARAM

    def point(computed, prefix, policy):
        own = sum(n * n for n in computed)
        pool = sum(2 * n * p for n, p in zip(computed, prefix))
        longest = max(n + p for n, p in zip(computed, prefix))
        t = 1e-3 + 2e-7 * sum(computed) + 1e-10 * own + 3e-10 * pool + 8e-7 * longest
        return {"rows": len(computed), "tokens": sum(computed), "computed": list(computed), "prefix": list(prefix),
                "median_s": t, "p10_s": t * 0.98, "p90_s": t * 1.02, "policy": policy}

    whole = [point([n] * w, [0] * w, "padded") for w in (1, 2, 4) for n in (64, 512, 2048, 8192)]
    chunks = [point([512], [p], "chunked") for p in (512, 4096, 8192, 16384)]
    fused = [point([1] * d + [512 - d], [k] * d + [p], "mixed") for d in (4, 16, 32) for k in (256, 2048, 8192)
             for p in (0, 2048)]
    without = fit_prefill(whole + chunks)
    assert PATH_PARAM not in without
    both = fit_prefill(whole + chunks + fused)
    assert PREFIX_PARAM in both and both[PATH_PARAM] == pytest.approx(8e-7, rel=0.15)
    base = linear_table()
    cost = CostModel({**base, "fit": {**base["fit"], "prefill": both}})
    for p in whole + chunks + fused:
        assert cost.prefill(PrefillShape.of(p["computed"], p["prefix"])) == pytest.approx(p["median_s"], rel=0.05)


def test_attention_over_the_pool_gets_its_own_coefficient_where_points_have_it():
    """Points whose chunks read a prefix from the pool at 3x the cost a unit of in-step attention: the fit prices
    the pool's part apart (and recovers both kinds); points without any prefix keep the one coefficient."""
    from servecap.costs.fit import fit_prefill
    from servecap.costs.table import PREFIX_PARAM

    def point(computed, prefix):
        own = sum(n * n for n in computed)
        pool = sum(2 * n * p for n, p in zip(computed, prefix))
        t = 1e-3 + 2e-7 * sum(computed) + 1e-10 * own + 3e-10 * pool
        return {"rows": len(computed), "tokens": sum(computed), "computed": list(computed), "prefix": list(prefix),
                "median_s": t, "p10_s": t * 0.98, "p90_s": t * 1.02}

    whole = [point([n] * w, [0] * w) for w in (1, 2, 4) for n in (64, 512, 2048, 8192, 16384)]
    chunks = [point([512], [p]) for p in (512, 4096, 8192, 16384, 30000)]
    plain = fit_prefill(whole)
    assert PREFIX_PARAM not in plain
    both = fit_prefill(whole + chunks)
    assert both[PREFIX_PARAM] > 2 * both["per_token2_s"]
    base = linear_table()
    cost = CostModel({**base, "fit": {**base["fit"], "prefill": both}})
    for p in whole + chunks:
        shape = PrefillShape.of(p["computed"], p["prefix"])
        assert cost.prefill(shape) == pytest.approx(p["median_s"], rel=0.05)


def test_a_shorter_row_saves_at_most_what_a_token_of_each_row_costs_a_uniform_batch():
    """Noisy mixed steps (a shared CPU) cannot fit a saving that prices a batch of short rows below zero: the
    saving per token is bounded by the steepest uniform segment over the rows."""
    from servecap.costs.fit import fit_decode

    def point(kv_tokens, kv_max, t):
        return {"rows": 2, "kv_tokens": kv_tokens, "kv_max": kv_max, "median_s": t, "p10_s": t, "p90_s": t, "n": 9}
    uniform = [point(8, 4, 1.0e-3), point(72, 36, 1.1e-3)]
    fitted = fit_decode(uniform + [point(37, 36, 0.2e-3)])  # a step far too cheap for its shape
    bound = (1.1e-3 - 1.0e-3) / 32 / 2
    assert 0 < fitted["per_token_s"][0] <= bound * (1 + 1e-9)
    assert 1.1e-3 - fitted["per_token_s"][0] * (2 * 36 - 37) > 0
    assert fit_decode([point(8, 4, 1.0e-3), point(72, 36, 0.9e-3), point(37, 36, 0.2e-3)])["per_token_s"] == [0.0]


def test_a_shorter_rows_saving_never_takes_a_decode_step_below_the_uniform_batch_reading_as_much_kv():
    """One long row beside short ones: the fitted saving (per_token x the positions the shorter rows lack) is linear,
    so at long contexts it can pass what the rows actually save; a floored table holds the step at the uniform
    batch of the same rows and K/V, and prices it by the line where the line is above."""
    import copy
    raw = copy.deepcopy(linear_table())
    d = raw["fit"]["decode"]["paged"]
    assert d["floor"] == "uniform-mean"  # what the fit writes now
    uniform = CostModel(raw).decode("paged", 8, 8 * 1000, 1000)
    longest = CostModel(raw).decode("paged", 8, 8 * 4000, 4000)
    per_token = 1.5 * (longest - uniform) / 24000  # the line passes the uniform batch at the mean
    d["per_token_s"] = [per_token] * len(d["per_token_s"])
    cost = CostModel(raw)
    short = 8 * 4000 - (4000 + 7 * 572)  # 24,000 - 4: mean 1000 after flooring
    assert longest - per_token * short < uniform
    assert cost.decode("paged", 8, 4000 + 7 * 572, 4000) == pytest.approx(uniform, rel=1e-12)
    for lacking in (80, 8000, 23000):  # wherever the line is, the step is the larger of it and the floor
        mean = (8 * 4000 - lacking) // 8
        want = max(longest - per_token * lacking, cost.decode("paged", 8, 8 * mean, mean))
        assert cost.decode("paged", 8, 8 * 4000 - lacking, 4000) == pytest.approx(want, rel=1e-12)
    d["per_token_s"] = [0.2 * per_token] * len(d["per_token_s"])  # a gentle saving: the line holds, floor unused
    cost = CostModel(raw)
    assert cost.decode("paged", 8, 8 * 4000 - 80, 4000) == pytest.approx(longest - 0.2 * per_token * 80, rel=1e-12)
