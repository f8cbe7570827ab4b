"""Issue 21's CPU parts: the near-tie rule, the serving-context correction (--from-runs), prediction intervals,
GPU telemetry recording and the audit's text items."""
import pytest

pytest.importorskip("torch")  # engine.parity imports torch; the rest of this file does not need it

from engine.parity import Mismatch, near_tie_bound  # noqa: E402

# Qwen2.5-1.5B: 28 layers; a logit RMS near 0.8 is what seeded random weights give (the Mismatch's bound is
# computed from the reference's own logits at the token).
LAYERS, SCALE = 28, 0.8


def _mismatch(margin: float, logit_diff: float) -> Mismatch:
    return Mismatch("s", "paged", 0, 0, 1, 2, margin, logit_diff, near_tie_bound(SCALE, LAYERS))


def test_near_tie_bound_is_fp16_rounding_at_the_logit_scale():
    # 3 sd of the margin's error: 6 sqrt(8 * 28 + 2) 2^-11 s
    assert near_tie_bound(1.0, 28) == pytest.approx(6 * 226 ** 0.5 * 2 ** -11)
    assert near_tie_bound(2.0, 28) == pytest.approx(2 * near_tie_bound(1.0, 28))
    assert near_tie_bound(1.0, 28, 2.0 ** -24) < 1e-5  # float32 on the CPU: no flip is excused


def test_a_large_engine_error_does_not_excuse_a_margin_above_the_bound():
    bound = near_tie_bound(SCALE, LAYERS)
    m = _mismatch(margin=1.5 * bound, logit_diff=10.0)  # the old rule (margin <= 2 x diff) excused this
    assert not m.near_tie


def test_a_genuine_near_tie_is_excused_however_small_the_engine_error():
    bound = near_tie_bound(SCALE, LAYERS)
    m = _mismatch(margin=0.5 * bound, logit_diff=1e-4)  # the old rule did not excuse this
    assert m.near_tie
