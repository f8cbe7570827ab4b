"""Causal prefill attention over packed variable-length sequences, GQA (flash-attention forward).

Layout: a step's tokens are packed back to back. q [T, Hq, D] and out [T, Hq, D] are contiguous; k [T, Hkv, D]
and v [T, Hkv, D] may have any row stride (v is typically a column slice of the fused QKV projection's output)
but each row's heads are contiguous. Sequence s owns tokens seq_start[s] .. seq_start[s] + seq_len[s] - 1, and its
query r (0-based in the sequence) attends to its keys 0..r; seq_len 0 is an empty slot. A sequence may also have a
prefix: positions computed by earlier steps (a chunked prompt's earlier chunks), read from the layer's paged KV
pool through its block table and visible to all of its queries.

Work list: program i of grid axis 0 takes the BLOCK_M queries from block_q[i] of sequence block_seq[i] (-1: no
work), and grid axis 1 the query heads. `plan` builds the list on the host with numpy.

Graph-capture contract: the kernel reads every data-dependent bound (sequences, work list) on the device, takes no
integer argument that varies with the step's shape (so it compiles once), and the call allocates nothing when
`out` and the prefix tensors are given and never reads a value back to the host. A graph captured with a work list of
max_programs(tokens, sequences, block_m) entries therefore replays any step whose tokens and sequences fit those
bounds: the host copies that step's plan, padded with -1, into the captured index tensors. Rows of `out` that no
program covers (a token bucket's padding) are left untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .online_softmax import online_softmax_step

_LOG2E = 1.4426950408889634
# Hopper, D=128, fp16: a 128-query tile keeps the tensor cores fed; K/V tiles of 64 keys, three deep in flight.
GPU_BLOCK_M, GPU_BLOCK_N, GPU_NUM_WARPS, GPU_NUM_STAGES = 128, 64, 8, 3
# Under the interpreter, small tiles give the CPU tests' short sequences several query and key tiles each, cheaply.
INTERPRET_BLOCK_M, INTERPRET_BLOCK_N = 16, 16


@triton.jit
def _attend_keys(acc, l_i, m_i, q, k_base, v_base, k_stride, v_stride, qk_scale, offs_m, seq_len, n_lo, n_hi,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax of the query tile over keys [n_lo, n_hi), one BLOCK_N tile at a time.

    MASKED applies the causal mask and bounds the loads by the sequence end; without it every key must be inside
    the sequence and visible to every query.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n in range(n_lo, n_hi, BLOCK_N):
        keys = n + offs_n
        k_ptrs = k_base + keys[:, None] * k_stride + offs_d[None, :]
        v_ptrs = v_base + keys[:, None] * v_stride + offs_d[None, :]
        if MASKED:
            valid = keys < seq_len
            # Rows past the sequence may hold garbage, even NaN, or lie past the tensor's end; and p = 0 there
            # does not cancel a NaN in p @ V.
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:  # the causal mask alone hides the keys past the end from every query inside the sequence
            s = tl.where(keys[None, :] <= offs_m[:, None], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _prefix_keys(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_row, prefix, qk_scale, kv_head,
                 NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax of the query tile over the sequence's first `prefix` positions, already in the paged pool
    (a chunk's earlier chunks): every query sees all of them. One pool block (PAGE positions) at a time."""
    offs_p = tl.arange(0, PAGE)
    offs_d = tl.arange(0, HEAD_DIM)
    tile = kv_head * (PAGE * HEAD_DIM) + offs_p[:, None] * HEAD_DIM + offs_d[None, :]
    for j in range(0, prefix, PAGE):
        base = tl.load(table_row + j // PAGE).to(tl.int64) * (NUM_KV_HEADS * PAGE * HEAD_DIM)
        valid = j + offs_p < prefix
        k = tl.load(k_cache_ptr + base + tile, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + base + tile, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, len_ptr, block_seq_ptr, block_q_ptr, qk_scale,
                    k_stride, v_stride, prefix_ptr, tables_ptr, table_stride, k_cache_ptr, v_cache_ptr,
                    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    work = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(block_seq_ptr + work)
    if seq < 0:
        return
    q_lo = tl.load(block_q_ptr + work)
    seq_len = tl.load(len_ptr + seq)
    if q_lo >= seq_len:
        return
    start = tl.load(start_ptr + seq).to(tl.int64)
    kv_head = head // GROUP

    offs_m = q_lo + tl.arange(0, BLOCK_M)  # query positions in the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < seq_len
    q_rows = q_ptr + (start * NUM_Q_HEADS + head) * HEAD_DIM
    q = tl.load(q_rows + offs_m[:, None] * (NUM_Q_HEADS * HEAD_DIM) + offs_d[None, :], mask=m_valid[:, None],
                other=0.0)

    k_base = k_ptr + start * k_stride + kv_head * HEAD_DIM
    v_base = v_ptr + start * v_stride + kv_head * HEAD_DIM
    # The first key tile read is wholly visible, or is the diagonal's first, whose key `diag` every query sees: m is
    # finite after it, and a later tile masked out for some row rescales that row by exp2(0).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # A chunk's earlier positions are in the pool, visible to every query; a whole prompt has none.
    acc, l_i, m_i = _prefix_keys(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, tables_ptr + seq * table_stride,
                                 tl.load(prefix_ptr + seq), qk_scale, kv_head, NUM_KV_HEADS, PAGE, HEAD_DIM,
                                 DOT_PRECISION)
    # Key tiles wholly before the first query are visible to the whole tile and inside the sequence: no mask.
    # The rest, up to the causal limit of the last query, straddle the diagonal or the sequence end.
    diag = (q_lo // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, k_stride, v_stride, qk_scale, offs_m, seq_len, 0,
                                 diag, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, k_stride, v_stride, qk_scale, offs_m, seq_len,
                                 diag, tl.minimum(q_lo + BLOCK_M, seq_len), BLOCK_N, HEAD_DIM, True,
                                 DOT_PRECISION)

    # Every query in the sequence sees at least its own key, so l > 0 on the rows that are stored.
    o = acc / l_i[:, None]
    out_rows = out_ptr + (start * NUM_Q_HEADS + head) * HEAD_DIM
    tl.store(out_rows + offs_m[:, None] * (NUM_Q_HEADS * HEAD_DIM) + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class Plan:
    """One step's sequences and work list, int32 arrays ready to copy into the kernel's index tensors."""
    seq_start: np.ndarray  # [S]
    seq_len: np.ndarray  # [S]
    block_seq: np.ndarray  # [NB]; -1 marks an idle program
    block_q: np.ndarray  # [NB]


def default_block_m(device: torch.device | str) -> int:
    """The query tile of prefill_attention on this device; the planner must use the same."""
    return GPU_BLOCK_M if torch.device(device).type == "cuda" else INTERPRET_BLOCK_M


def max_programs(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """Most query tiles (programs) any split of num_tokens tokens into at most num_seqs sequences needs.

    A sequence of L tokens takes floor((L + block_m - 1) / block_m) tiles; summed over the at most
    min(num_seqs, num_tokens) non-empty sequences, that is at most the value returned, which sequences of
    lengths 1 mod block_m reach.
    """
    return (num_tokens + min(num_seqs, num_tokens) * (block_m - 1)) // block_m


def plan(lengths: Sequence[int], block_m: int, num_programs: int | None = None) -> Plan:
    """Pack sequences of these lengths back to back and list their query tiles, padded to num_programs with -1.

    The tiles deepest into their sequence, which have the most keys to read, come first so they start first and
    the short ones fill in behind them. Raises ValueError if the tiles outnumber num_programs.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if (lens < 0).any():
        raise ValueError(f"negative sequence length in {lens.tolist()}")
    starts = np.cumsum(lens) - lens
    tiles = -(-lens // block_m)
    block_seq = np.repeat(np.arange(len(lens)), tiles)
    block_q = (np.arange(len(block_seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * block_m
    order = np.argsort(-block_q, kind="stable")
    block_seq, block_q = block_seq[order], block_q[order]
    if num_programs is not None:
        if len(block_seq) > num_programs:
            raise ValueError(f"{len(block_seq)} query tiles do not fit {num_programs} programs")
        pad = num_programs - len(block_seq)
        block_seq = np.concatenate([block_seq, np.full(pad, -1)])
        block_q = np.concatenate([block_q, np.full(pad, -1)])
    return Plan(starts.astype(np.int32), lens.astype(np.int32), block_seq.astype(np.int32),
                block_q.astype(np.int32))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
                      seq_len: torch.Tensor, block_seq: torch.Tensor, block_q: torch.Tensor, scale: float, *,
                      out: torch.Tensor | None = None, block_m: int | None = None,
                      prefix_len: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                      k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each packed sequence's queries over its own keys; returns out [T, Hq, D] in q's dtype.

    q [T, Hq, D] contiguous; k, v [T, Hkv, D] with any row stride, heads contiguous. seq_start, seq_len [>= S] and
    block_seq, block_q [NB] (from `plan`, made with this block_m) are int32 on q's device; NB is the grid.
    With a prefix (a chunk of a longer prompt): sequence s's queries also attend to its first prefix_len[s]
    positions, read from the layer's paged caches k_cache, v_cache [blocks, Hkv, block size, D] through
    block_tables [>= S, max blocks] (int32), all visible to every query of the chunk.
    """
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.is_contiguous() and num_q_heads % num_kv_heads == 0 and v.shape[1:] == k.shape[1:]
    assert k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
    assert block_seq.shape == block_q.shape
    assert seq_start.dtype == seq_len.dtype == block_seq.dtype == block_q.dtype == torch.int32
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == q.dtype
    on_gpu = q.device.type == "cuda"
    block_m = default_block_m(q.device) if block_m is None else block_m
    block_n = GPU_BLOCK_N if on_gpu else INTERPRET_BLOCK_N
    if prefix_len is None:  # no sequence has a prefix: zero lengths, and stand-ins for the pool that is never read
        prefix_len = torch.zeros_like(seq_len)
        block_tables = torch.zeros((seq_len.shape[0], 1), dtype=torch.int32, device=q.device)
        k_cache = v_cache = k.new_empty((1, num_kv_heads, INTERPRET_BLOCK_N, head_dim))
    assert prefix_len.dtype == block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == num_kv_heads
    # Row strides are fixed by the model, so they cost no recompiles; Triton specialises them on divisibility by
    # 16, and only then can the K/V tile loads vectorise into the asynchronous copies that pipeline the key loop.
    _prefill_kernel[(block_seq.shape[0], num_q_heads)](
        q, k, v, out, seq_start, seq_len, block_seq, block_q, scale * _LOG2E, k.stride(0), v.stride(0),
        prefix_len, block_tables, block_tables.stride(0), k_cache, v_cache,
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_KV_HEADS=num_kv_heads, PAGE=k_cache.shape[2],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp16 ignores it
        num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES)
    return out
