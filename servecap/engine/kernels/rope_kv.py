"""RoPE on the fused QKV projection's q and k, and the store of k and v into the paged KV cache, in one pass.

RoPE is HF's rotate_half convention (Qwen2): for a head x = [x1, x2], out = [x1*cos - x2*sin, x2*cos + x1*sin].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_cos_sin(head_dim: int, max_pos: int, theta: float,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos(pos * inv_freq) in the first half of each row, sin in the second.

    inv_freq and the angles are computed in float32 exactly as transformers' Qwen2RotaryEmbedding does.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq.to(device)[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


@triton.jit
def _rope_heads(src, dst, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rotate NUM_HEADS contiguous heads at src, store them at dst, and return the rotated halves in fp32."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h < NUM_HEADS)[:, None]
    offs = offs_h[:, None] * HEAD_DIM + tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst + offs, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + offs + HALF, o2.to(dst.dtype.element_ty), mask=mask)
    return o1, o2


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
                    qkv_stride, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + offs)

    q_src = qkv_ptr + t.to(tl.int64) * qkv_stride
    k_src = q_src + NUM_Q_HEADS * HEAD_DIM
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM
    _rope_heads(q_src, q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM), cos, sin, NUM_Q_HEADS, Q_PAD, HEAD_DIM)
    k1, k2 = _rope_heads(k_src, k_out_ptr + t * (NUM_KV_HEADS * HEAD_DIM), cos, sin, NUM_KV_HEADS, KV_PAD, HEAD_DIM)

    # Slot -1 marks a token whose K/V must not land in the cache (left padding in prefill).
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, KV_PAD)
    mask = ((offs_h < NUM_KV_HEADS) & (slot >= 0))[:, None]
    dst = (((slot // BLOCK) * NUM_KV_HEADS + offs_h[:, None]) * BLOCK + slot % BLOCK) * HEAD_DIM + offs[None, :]
    src = offs_h[:, None] * HEAD_DIM + offs[None, :]
    tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_src + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + src + HALF, mask=mask), mask=mask)


def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, q_out: torch.Tensor | None = None,
            k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Roped q [T, Hq, D] and k [T, Hkv, D] from qkv [T, (Hq + 2*Hkv) * D]; stores roped k and raw v at slot_mapping.

    positions and slot_mapping are [T] integer tensors (int32 or int64) on qkv's device; a slot is
    block_id * block_size + offset into the caches [num_blocks, Hkv, block_size, D], and -1 skips the store.
    cos_sin comes from rope_cos_sin. qkv's rows may be strided but each row is contiguous; the caches are contiguous.
    """
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_tokens = qkv.shape[0]
    num_q_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()
    assert cos_sin.shape[1] == head_dim and v_cache.dtype == qkv.dtype
    if q_out is None:
        q_out = qkv.new_empty(num_tokens, num_q_heads, head_dim)
    if k_out is None:
        k_out = qkv.new_empty(num_tokens, num_kv_heads, head_dim)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    _rope_kv_kernel[(num_tokens,)](
        qkv, positions, cos_sin, slot_mapping, q_out, k_out, k_cache, v_cache, qkv.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_PAD=triton.next_power_of_2(num_q_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, BLOCK=block_size, num_warps=4)
    return q_out, k_out
