"""Paged decode attention: one query token per row against that row's KV blocks, split over the KV (flash-decoding).

Cache layout per layer: k_cache and v_cache are each [num_blocks, num_kv_heads, block_size, head_dim], contiguous,
so the K (or V) of one (block, kv head) is one contiguous block_size x head_dim tile.

The call launches a fixed grid and allocates nothing when `out` and `workspace` are given, and never reads a
value back to the host, so it can be captured in a CUDA graph; every data-dependent bound is read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .online_softmax import online_softmax_step

NUM_WARPS = 4
NUM_STAGES = 3  # K and V tiles of the next blocks load while the current one is reduced: decode is bandwidth-bound
MAX_SPLITS = 64  # the combine kernel holds all of a head's partials in one tile
_LOG2E = 1.4426950408889634
_SPAN_CHUNK = 128  # seq_lens entries read per step when pad_to_span looks for the widest row


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, qk_scale, bt_stride, max_blocks,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, SPAN_CHUNK: tl.constexpr,
                  PAD_TO_SPAN: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(lens_ptr + row)
    span = seq_len
    if PAD_TO_SPAN:  # every row walks the widest row's blocks, as a dense padded batch would
        batch = tl.num_programs(0)
        for i in range(0, batch, SPAN_CHUNK):
            offs = i + tl.arange(0, SPAN_CHUNK)
            span = tl.maximum(span, tl.max(tl.load(lens_ptr + offs, mask=offs < batch, other=0)))
    n_blocks = tl.cdiv(span, BLOCK)
    # Splits cover fixed block ranges of the table, not a share of each row: a long row spreads over more
    # programs instead of lengthening every program's loop, so a step costs the blocks read, not the longest row.
    per_split = tl.cdiv(max_blocks, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, n_blocks)

    # All GROUP query heads of this kv head as the rows of one tile: each K/V tile is read once for them.
    offs_g = tl.arange(0, GROUP_PAD)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + (row * (NUM_KV_HEADS * GROUP) + head[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    # m starts finite so a block with every position masked (pad_to_span) rescales by exp2(0), not exp2(nan).
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    tile = kv_head * (BLOCK * HEAD_DIM) + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    bt_row = bt_ptr + row * bt_stride
    for j in range(start, end):
        base = tl.load(bt_row + j).to(tl.int64) * (NUM_KV_HEADS * BLOCK * HEAD_DIM)
        valid = j * BLOCK + offs_n < seq_len
        k = tl.load(k_ptr + base + tile)
        # Slots past seq_len may hold garbage, even NaN, and p = 0 there does not cancel a NaN in p @ V.
        v = tl.load(v_ptr + base + tile, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION)

    # A split with no keys (past the row's blocks, or seq_len 0) leaves l = 0: it yields zeros and lse = -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(out_ptr + (row * (NUM_KV_HEADS * GROUP) + head[:, None]) * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        idx = (row * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
        tl.store(part_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(lse_ptr + idx, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    idx = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)  # (row, q head) flattened
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + idx * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all splits empty: every weight is 0
    part = tl.load(part_ptr + (idx * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + idx * HEAD_DIM + offs_d, o.to(out_ptr.dtype.element_ty))


def paged_attention_workspace(max_batch: int, num_q_heads: int, head_dim: int, num_splits: int,
                              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 split partials for up to max_batch rows: (outputs [max_batch, Hq, S, D], base-2 lse [max_batch, Hq, S])."""
    return (torch.empty(max_batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(max_batch, num_q_heads, num_splits, dtype=torch.float32, device=device))


def default_num_splits(batch: int, num_kv_heads: int, *, max_blocks: int) -> int:
    """Splits of a few blocks each across the block table's width (max_blocks, fixed for a CUDA graph).

    A split covers the same block range in every row, so a long row spreads over more programs rather than
    lengthening all of them: the step costs the blocks read, not the longest row's walk. Four blocks a split
    once the batch gives enough programs; two for small batches, which need the extra parallelism.
    """
    chunk = 4 if batch * num_kv_heads >= 16 else 2
    return max(1, min(triton.cdiv(max_blocks, chunk), MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, *, num_splits: int, pad_to_span: bool = False,
                    out: torch.Tensor | None = None,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, D] over each row's first seq_lens[i] cached tokens; returns out [B, Hq, D] in q's dtype.

    block_tables [>= B, max_blocks] int32 and seq_lens [>= B] int32 live on q's device. q, out and the caches are
    contiguous. With num_splits > 1 the partials go to `workspace` (from paged_attention_workspace, for >= B rows
    and exactly num_splits splits); with num_splits == 1 the kernel writes `out` directly and needs none.
    """
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert num_q_heads % num_kv_heads == 0 and block_tables.stride(1) == 1
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.is_contiguous()
    direct = num_splits == 1
    if direct:
        part, lse = out, out  # not touched
    else:
        part, lse = workspace if workspace is not None else paged_attention_workspace(
            batch, num_q_heads, head_dim, num_splits, q.device)
        assert part.shape[0] >= batch and part.shape[1:] == (num_q_heads, num_splits, head_dim)
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, lse, scale * _LOG2E, block_tables.stride(0),
        block_tables.shape[1],
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK=block_size, HEAD_DIM=head_dim, SPAN_CHUNK=_SPAN_CHUNK, PAD_TO_SPAN=pad_to_span, DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32; fp16 ignores it
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if not direct:
        _combine_kernel[(batch, num_q_heads)](
            part, lse, out, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, num_warps=NUM_WARPS)
    return out
