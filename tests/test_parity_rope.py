"""The fp16 parity reference runs Qwen2's RoPE: issue #21's long-prompt drift (results/engine/parity-fp32/CAUSE.md).

The engine's first-token logits drifted from the probe's "fp32" HF reference as the prompt grew (0.014 at 16 tokens,
0.42 at 4096) while HF's fp16 run stayed within 0.019 of it. The drift was the reference's: the seeded model was
built in float32 and cast with `.to(float16)`, which rounded RoPE's inv_freq buffer to fp16 (up to 0.9% off), and
the probe's fp32 copy (`deepcopy(hf).float()`) inherited the rounded frequencies. HF fp16 and that copy agreed with
each other, on the wrong angles; the engine computes Qwen2's. The engine's own long-prompt attention is checked here
too: in fp16 it stays at one rounding of the exact result at 2048 keys.
"""
from __future__ import annotations

import copy

import pytest
import torch

from servecap.engine.kernels import plan, prefill_attention, rope_cos_sin
from servecap.engine.weights import load_model
from servecap.traces.model_spec import QWEN25_1P5B, TINY_QWEN2

# The real model's RoPE (head_dim 128, rope_theta 1e6) on a body small enough to build on a CPU.
ROPE_SPEC = dict(QWEN25_1P5B, name="rope-probe", hidden_size=256, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, intermediate_size=256, vocab_size=256)
POSITIONS = torch.tensor([0, 1, 15, 1000, 2047, 4095, 8191])
FP16_HALF_ULP = 2.0 ** -12  # |cos|, |sin| <= 1: one fp16 rounding moves them at most this much


def hf_cos_sin(hf, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0].double(), sin[0].double()


def exact_cos_sin(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2's angles in float64 from float32 frequencies (the engine's rope_cos_sin holds them in float32)."""
    table = rope_cos_sin(head_dim, int(positions.max()) + 1, theta).double()[positions]
    half = head_dim // 2
    return torch.cat([table[:, :half]] * 2, -1), torch.cat([table[:, half:]] * 2, -1)


def test_seeded_fp16_model_keeps_rope_frequencies_in_float32():
    loaded = load_model(None, ROPE_SPEC, seed=0, dtype=torch.float16, device="cpu")
    hf = loaded.hf
    assert all(p.dtype == torch.float16 for p in hf.parameters())
    # HF's fp16 cos/sin at long positions: one fp16 rounding of Qwen2's (the old cast: 0.73 off at 4095).
    cos, sin = hf_cos_sin(hf, POSITIONS, torch.float16)
    ref_cos, ref_sin = exact_cos_sin(128, ROPE_SPEC["rope_theta"], POSITIONS)
    err = torch.maximum((cos - ref_cos).abs(), (sin - ref_sin).abs()).amax(-1)
    assert (err <= FP16_HALF_ULP).all(), dict(zip(POSITIONS.tolist(), err.tolist()))
    rotary = hf.model.rotary_emb
    assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
    want, _ = rotary.compute_default_rope_parameters(hf.config)
    assert torch.equal(rotary.inv_freq, want) and torch.equal(rotary.original_inv_freq, want)
    # The probe's float32 reference, a float() copy of the fp16 model, computes exactly the engine's angles.
    cos32, sin32 = hf_cos_sin(copy.deepcopy(hf).float(), POSITIONS, torch.float32)
    assert torch.equal(cos32, ref_cos) and torch.equal(sin32, ref_sin)


def test_seeded_weights_are_the_same_values_as_before_the_fix():
    """Only the buffers changed: the weights are still the float32 init cast to fp16, seed for seed."""
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    from servecap.engine.weights import hf_config
    old = Qwen2ForCausalLM(hf_config(TINY_QWEN2)).to(torch.float16)
    new = load_model(None, TINY_QWEN2, seed=0, dtype=torch.float16, device="cpu").hf
    old_params, new_params = dict(old.named_parameters()), dict(new.named_parameters())
    assert old_params.keys() == new_params.keys()
    assert all(torch.equal(old_params[k], new_params[k]) for k in old_params)


def test_checkpoint_loaded_in_fp16_keeps_rope_frequencies_in_float32(tmp_path):
    load_model(None, TINY_QWEN2, seed=0, dtype=torch.float32, device="cpu").hf.save_pretrained(tmp_path)
    hf = load_model(tmp_path, TINY_QWEN2, dtype=torch.float16, device="cpu").hf
    assert hf.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("num_keys", [256, 2048])
def test_prefill_attention_fp16_error_does_not_grow_with_the_keys(num_keys):
    """The last query tile of one sequence of num_keys tokens, head_dim 128, fp16 in and out, against float64: the
    kernel's error is the output's own fp16 rounding, plus a little, however many keys it reads."""
    gen = torch.Generator().manual_seed(0)
    head_dim, num_q_heads = 128, 2
    q = (3 * torch.randn(num_keys, num_q_heads, head_dim, generator=gen)).half()
    k = (3 * torch.randn(num_keys, 1, head_dim, generator=gen)).half()
    v = torch.randn(num_keys, 1, head_dim, generator=gen).half()
    block_m = 16
    p = plan([num_keys], block_m)
    start, length = torch.from_numpy(p.seq_start), torch.from_numpy(p.seq_len)
    lo = num_keys - block_m  # only the deepest tile: it reads every key
    out = prefill_attention(q, k, v, start, length, torch.zeros(1, dtype=torch.int32),
                            torch.tensor([lo], dtype=torch.int32), head_dim ** -0.5, block_m=block_m)[lo:].double()
    scores = torch.einsum("mhd,nd->hmn", q[lo:].double(), k[:, 0].double()) * head_dim ** -0.5
    causal = torch.arange(num_keys)[None, :] <= torch.arange(lo, num_keys)[:, None]
    ref = torch.einsum("hmn,nd->mhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v[:, 0].double())
    rounding = (ref.half().double() - ref).abs()  # the output's own fp16 rounding, elementwise
    assert ((out - ref).abs() <= 2 * rounding + 2e-4 * ref.abs().max()).all()
