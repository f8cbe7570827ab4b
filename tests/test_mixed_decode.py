"""Fused steps whose decode rows the engine attends with its paged decode kernel: how the cost model prices them, how
a fit learns their terms, the what-if table that predicts them from a table measured before, and plans made on an
earlier plan's points."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from servecap.costs.fit import fit_prefill
from servecap.costs.model import CostModel, kv_read_per_token, mixed_decode_terms, prefill_time
from servecap.costs.shapes import PrefillShape
from servecap.costs.synthetic import linear_table
from servecap.costs.table import CostTable, table_id

from shared_data import REPO as ROOT

PARAMS = (2e-3, 4e-5, 1e-4, 4e-6, 2e-10, 3.0)  # PREFILL_PARAMS order


def fused(decode: list[int], chunk: int, prefix: int = 0) -> PrefillShape:
    return PrefillShape.of([1] * len(decode) + [chunk], decode + [prefix], len(decode))


def paged_engine(raw: dict, **fit) -> CostModel:
    t = {**raw, "engine": {**raw.get("engine", {}), "mixed_decode_attention": "paged"}}
    t["fit"] = {**t["fit"], "prefill": {**t["fit"]["prefill"], **fit}}
    t["table_id"] = table_id(t)
    return CostModel(CostTable(t))


def test_a_fused_steps_decode_rows_cost_their_kv_reads_and_their_attention_is_not_the_prefill_kernels():
    raw = linear_table()
    old, new = CostModel(CostTable(raw)), paged_engine(raw)
    per_token, fixed = mixed_decode_terms(new.table)
    assert fixed == 0.0 and per_token == pytest.approx(kv_read_per_token(raw["fit"]["decode"]["paged"]))
    assert per_token > 0
    a, b = fused([900, 1200, 300], 500), fused([1000, 1300, 400], 500)
    # 100 more K/V tokens in each of 3 rows: exactly 300 tokens' reads more, on the decode kernel's terms.
    assert new.prefill(b) - new.prefill(a) == pytest.approx(300 * per_token, rel=1e-9)
    # Without its decode rows' attention the prefill surface prices the step's positions: the same bucket of
    # tokens as the whole step, with the chunk's attention only.
    rows_only = PrefillShape.of([1, 1, 1, 500], [0, 0, 0, 0], 3)
    assert new.prefill(a) == pytest.approx(new.prefill(rows_only) + per_token * (900 + 1200 + 300), rel=1e-9)
    # An engine that attends them with its prefill kernel is priced as before, whatever the shape's decode count.
    assert old.prefill(a) == old.prefill(PrefillShape(a.computed, a.prefix))
    assert mixed_decode_terms(old.table) is None


def test_a_table_naming_another_kind_of_fused_attention_is_refused_in_one_line():
    from servecap.costs.table import check_table
    from servecap.traces.errors import InputError
    t = {**linear_table(), "engine": {"mixed_decode_attention": "flash"}}
    t["table_id"] = table_id(t)
    with pytest.raises(InputError, match="mixed_decode_attention must be 'paged' or absent, got 'flash'"):
        check_table(t)


def test_a_tables_own_fitted_terms_win_over_the_derived_ones():
    raw = linear_table()
    m = paged_engine(raw, mixed_decode_per_token_s=3e-9, mixed_decode_s=2e-4)
    assert mixed_decode_terms(m.table) == (3e-9, 2e-4)
    a = fused([1000] * 4, 300)
    assert m.prefill(a) - m.prefill(fused([0] * 4, 300)) == pytest.approx(3e-9 * 4000, rel=1e-9)


def test_the_fit_learns_the_decode_rows_terms_from_fused_points():
    rng = np.random.default_rng(0)
    shapes = [PrefillShape.padded(w, n) for w in (1, 4, 16) for n in (64, 512, 2048)]
    shapes += [PrefillShape.of([c], [p]) for c in (256, 512) for p in (512, 2048)]
    shapes += [fused(list(rng.integers(64, 4000, d)), 512 - d, int(rng.integers(0, 2000)))
               for d in (2, 8, 16, 24, 31) for _ in range(6)]
    per_token, fixed = 8e-9, 3e-4

    def truth(s: PrefillShape) -> float:
        a = s.prompts if s.decode else s
        pool_work = sum(2 * n * p for n, p in zip(a.computed, a.prefix))
        own = sum(n * (n + 2 * p) for n, p in zip(a.computed, a.prefix)) - pool_work
        pool = 5e-11 * pool_work
        t = float(prefill_time(PARAMS, s.rows, s.tokens, own / s.tokens, pool))
        return t + (fixed + per_token * sum(p + 1 for p in s.prefix[:s.decode]) if s.decode else 0.0)

    points = [{"policy": "mixed" if s.decode else "padded", "rows": s.rows, "tokens": s.tokens, "attn": s.attn,
               "computed": list(s.computed), "prefix": list(s.prefix), **({"decode": s.decode} if s.decode else {}),
               "median_s": truth(s), "p10_s": truth(s) * 0.99, "p90_s": truth(s) * 1.01, "n": 5} for s in shapes]
    engine = {"mixed_decode_attention": "paged"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = fit_prefill(points, engine)  # no decode fit: both terms from the fused points
        held = fit_prefill(points, engine, kv_per_token=per_token)  # the decode kernel's reads as decode measures them
        other = fit_prefill(points, {}, kv_per_token=per_token)
    assert free["mixed_decode_per_token_s"] == pytest.approx(per_token, rel=0.1)
    assert free["mixed_decode_s"] == pytest.approx(fixed, rel=0.25)
    assert held["mixed_decode_per_token_s"] == per_token and held["mixed_decode_s"] == pytest.approx(fixed, rel=0.1)
    # An engine that attends them with its prefill kernel gets no such terms from the same points.
    assert "mixed_decode_per_token_s" not in other


def test_the_what_if_table_prices_fused_steps_with_the_decode_kernel_and_drops_their_serving_factors(tmp_path):
    src = ROOT / "results/calibration/t6d-serving/h200-t6d-serving.json"
    out = tmp_path / "what-if.json"
    cmd = [sys.executable, str(ROOT / "scripts/what_if_mixed_decode.py"), str(src), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    t, s = json.loads(out.read_text()), json.loads(src.read_text())
    assert t["engine"]["mixed_decode_attention"] == "paged" and t["derived"]["from_table"] == s["table_id"]
    assert not any(k.startswith("prefill mixed") for k in t["correction"]["factors"])
    assert any(k.startswith("prefill mixed") for k in s["correction"]["factors"])
    assert t["fit"] == s["fit"] and t["table_id"] == table_id(t)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


T8B = ROOT / "results/calibration/t8b/h200-t8b.json"


@pytest.fixture(scope="module")
def measured() -> CostModel:
    from servecap.costs.table import load_cost_table
    return CostModel(load_cost_table(T8B))


def test_a_measured_table_prices_fused_steps_from_their_rows_reads_whatever_their_shape(measured):
    """Properties over random fused steps on a table measured on the engine that attends so (T8b): a positive
    duration; each decode row's K/V token adds exactly the fitted rate, however the tokens spread over the rows; and
    moving decode rows' K/V between them changes nothing."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    per_token, fixed = mixed_decode_terms(measured.table)
    assert per_token > 0 and fixed > 0

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(1, 4000), min_size=1, max_size=31), st.integers(1, 480), st.integers(0, 3000),
           st.integers(1, 400))
    def check(decode, chunk, prefix, more):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = measured.prefill(fused(decode, chunk, prefix))
            longer = measured.prefill(fused([decode[0] + more, *decode[1:]], chunk, prefix))
            moved = measured.prefill(fused([*decode[1:], decode[0]], chunk, prefix))
        assert a > 0 and np.isfinite(a)
        assert longer - a == pytest.approx(more * per_token, rel=1e-6, abs=1e-12)
        assert moved == pytest.approx(a, rel=1e-12)

    check()
