"""The Triton kernels against float64 torch references.

Without CUDA, importing engine.kernels switches Triton to its interpreter, so these run on the CPU in float32 on
small shapes; with CUDA the same tests run compiled on the GPU, plus fp16 ones at the model's shapes.
Outputs and caches are filled with NaN before each call: every element that should be written must be, and
nothing else may be.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from servecap.engine.kernels import (add_rms_norm, default_block_m, default_num_splits, max_programs, paged_attention,
                            paged_attention_workspace, plan, prefill_attention, rms_norm, rope_cos_sin, rope_kv)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- paged attention -----------------------------------------------------------------------------------------

def make_paged_kv(lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, max_blocks: int,
                  dtype: torch.dtype, gen: torch.Generator, extra_rows: int = 0):
    """Caches holding each row's K/V in shuffled blocks; every other slot, and the spare blocks, hold NaN.

    Returns (k_cache, v_cache, block_tables, dense) with dense[i] = (K, V) of row i as [Hkv, len, D] float64.
    Table entries past a row's own blocks point at spare (NaN) blocks, as the caller's contract allows.
    """
    own = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(own) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    spare = ids[sum(own):]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = spare[torch.randint(len(spare), (len(lens) + extra_rows, max_blocks), generator=gen)]
    dense, taken = [], 0
    for i, n in enumerate(lens):
        tables[i, :own[i]] = ids[taken:taken + own[i]]
        taken += own[i]
        k = torch.randn(num_kv_heads, n, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(num_kv_heads, n, head_dim, generator=gen, dtype=torch.float64)
        for p in range(n):
            block, off = tables[i, p // block_size], p % block_size
            k_cache[block, :, off] = k[:, p].to(dtype)
            v_cache[block, :, off] = v[:, p].to(dtype)
        dense.append((k.to(dtype).double(), v.to(dtype).double()))
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE, torch.int32), dense


def attention_reference(q: torch.Tensor, dense, scale: float) -> torch.Tensor:
    """Plain softmax attention per row over its gathered K/V, query head h reading kv head h // group."""
    outs = []
    for i, (k, v) in enumerate(dense):
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, len, D]
        scores = torch.einsum("hd,hnd->hn", q[i].double().cpu(), k) * scale
        outs.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def run_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, pad_to_span):
    """One call into NaN-poisoned out and workspace that are bigger than the batch, as the engine's static ones are."""
    batch, num_q_heads, head_dim = q.shape
    out = torch.full((batch + 2, num_q_heads, head_dim), float("nan"), dtype=q.dtype, device=DEVICE)
    part, lse = paged_attention_workspace(batch + 2, num_q_heads, head_dim, num_splits, DEVICE)
    part.fill_(float("nan"))
    lse.fill_(float("nan"))
    got = paged_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits,
                          pad_to_span=pad_to_span, out=out[:batch], workspace=(part, lse))
    assert got.data_ptr() == out.data_ptr()
    assert out[batch:].isnan().all(), "wrote past the batch"
    return got


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(3, 3, 32), (4, 2, 32), (12, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_paged_attention_matches_dense_softmax(num_q_heads, num_kv_heads, head_dim, block_size, num_splits):
    gen = torch.Generator().manual_seed(1000 * num_q_heads + 10 * block_size + num_splits)
    # One token, exactly one and three blocks, ragged; 7 splits is more than any row has blocks.
    lens = [1, block_size, 3 * block_size, 2 * block_size + 5, 7]
    k_cache, v_cache, tables, dense = make_paged_kv(lens, block_size, num_kv_heads, head_dim, max_blocks=4,
                                                    dtype=torch.float32, gen=gen, extra_rows=1)
    # seq_lens and the tables have a row past the batch, as the engine's static buffers do.
    seq_lens = torch.tensor(lens + [4 * block_size], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(DEVICE)
    scale = head_dim ** -0.5
    want = attention_reference(q, dense, scale)

    paged = run_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, pad_to_span=False)
    padded = run_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, pad_to_span=True)
    torch.testing.assert_close(paged.double().cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, paged, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pad_to_span", [False, True])
def test_paged_attention_empty_row_gives_zeros(pad_to_span):
    """A row of length 0 (a CUDA graph's padding row) yields zeros and leaves the other rows intact."""
    gen = torch.Generator().manual_seed(7)
    lens = [20, 0, 9]
    k_cache, v_cache, tables, dense = make_paged_kv(lens, 16, 2, 32, max_blocks=2, dtype=torch.float32, gen=gen)
    q = torch.randn(3, 4, 32, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        got = run_attention(q, k_cache, v_cache, tables, seq_lens, 32 ** -0.5, num_splits, pad_to_span)
        assert (got[1] == 0).all()
        want = attention_reference(q[[0, 2]], [dense[0], dense[2]], 32 ** -0.5)
        torch.testing.assert_close(got[[0, 2]].double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_default_num_splits():
    assert default_num_splits(1, 2, max_blocks=16) == 8  # short batch: two blocks a split
    assert default_num_splits(32, 2, max_blocks=16) == 4  # four blocks a split
    assert default_num_splits(32, 2, max_blocks=68) == 17  # the engine's table: 4352 tokens of 64-token blocks
    assert default_num_splits(1, 2, max_blocks=4096) == 64  # capped: the combine kernel holds every partial


# ---- RoPE + KV store -----------------------------------------------------------------------------------------

def test_rope_table_matches_transformers():
    modeling = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    from transformers import Qwen2Config
    config = Qwen2Config(hidden_size=12 * 128, num_attention_heads=12, num_key_value_heads=2,
                         rope_theta=1e6, max_position_embeddings=32768)
    positions = torch.tensor([[0, 1, 2, 63, 1000, 4097, 32767]])
    cos, sin = modeling.Qwen2RotaryEmbedding(config)(torch.zeros(1), positions)
    table = rope_cos_sin(128, 32768, 1e6)[positions[0]]
    assert torch.equal(table[:, :64], cos[0, :, :64]) and torch.equal(table[:, 64:], sin[0, :, :64])
    assert torch.equal(cos[0, :, :64], cos[0, :, 64:])  # HF's second half repeats the first: one half is enough


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb in float64: x * cos + rotate_half(x) * sin, cos and sin repeated over both halves."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 1), (4, 2), (12, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rope_kv_matches_reference(num_q_heads, num_kv_heads, index_dtype):
    gen = torch.Generator().manual_seed(num_q_heads * 10 + num_kv_heads)
    head_dim, block_size, num_blocks, max_pos, tokens = 32, 16, 5, 512, 9
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    # qkv is a row slice of a wider buffer: rows are strided, each row contiguous.
    qkv = torch.randn(tokens, width + 8, generator=gen)[:, :width].to(DEVICE)
    positions = torch.randint(max_pos, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # left padding: computed, never stored
    cos_sin = rope_cos_sin(head_dim, max_pos, 1e4, DEVICE)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    q_out = torch.full((tokens, num_q_heads, head_dim), float("nan"), device=DEVICE)
    k_out = torch.full((tokens, num_kv_heads, head_dim), float("nan"), device=DEVICE)

    got_q, got_k = rope_kv(qkv, positions.to(DEVICE, index_dtype), cos_sin, k_cache, v_cache,
                           slots.to(DEVICE, index_dtype), q_out=q_out, k_out=k_out)

    q, k, v = qkv.double().cpu().split([num_q_heads * head_dim, num_kv_heads * head_dim,
                                        num_kv_heads * head_dim], dim=1)
    cos, sin = cos_sin.double().cpu()[positions].chunk(2, dim=-1)
    want_q = rotate_half_reference(q.view(tokens, num_q_heads, head_dim), cos, sin)
    want_k = rotate_half_reference(k.view(tokens, num_kv_heads, head_dim), cos, sin)
    assert got_q.data_ptr() == q_out.data_ptr() and got_k.data_ptr() == k_out.data_ptr()
    torch.testing.assert_close(got_q.double().cpu(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.double().cpu(), want_k, rtol=1e-5, atol=1e-5)

    want_k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    want_v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k_cache[slot // block_size, :, slot % block_size] = want_k[t]
            want_v_cache[slot // block_size, :, slot % block_size] = v[t].view(num_kv_heads, head_dim)
    torch.testing.assert_close(k_cache.double().cpu(), want_k_cache, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(v_cache.double().cpu(), want_v_cache, rtol=0, atol=0, equal_nan=True)


# ---- RMSNorm -------------------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double().cpu(), weight.double().cpu()
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("hidden", [64, 1536, 8192])
def test_rms_norm_matches_reference(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(5, hidden + 4, generator=gen))[:, :hidden].to(DEVICE)  # strided rows
    weight = torch.randn(hidden, generator=gen).to(DEVICE)
    out = torch.full((5, hidden), float("nan"), device=DEVICE)
    assert rms_norm(x, weight, 1e-6, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double().cpu(), rms_norm_reference(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_place", [False, True])
def test_add_rms_norm_matches_reference(in_place):
    gen = torch.Generator().manual_seed(int(in_place))
    x = torch.randn(4, 1536, generator=gen).to(DEVICE)
    residual = torch.randn(4, 1536, generator=gen).to(DEVICE)
    weight = torch.randn(1536, generator=gen).to(DEVICE)
    want_residual = x.double().cpu() + residual.double().cpu()
    want = rms_norm_reference(want_residual, weight, 1e-5)
    if in_place:
        normed, new_residual = add_rms_norm(x, residual, weight, 1e-5, out=x, residual_out=residual)
        assert normed.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    else:
        normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual.double().cpu(), want_residual, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed.double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_matches_transformers_in_fp16():
    """The model's own order of roundings: residual add in fp16, normalize in fp32, cast, then weight in fp16."""
    modeling = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(6, 1536, generator=gen).half().to(DEVICE) for _ in range(2))
    norm = modeling.Qwen2RMSNorm(1536, eps=1e-6).half().to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(1536, generator=gen))
        want_residual = residual + x
        want = norm(want_residual)
    normed, new_residual = add_rms_norm(x, residual, norm.weight.detach(), 1e-6)
    assert torch.equal(new_residual, want_residual)
    # Only the fp32 sum's order differs from torch's, which rarely moves an fp16 rounding; multiplying by the
    # weight before the cast instead would change about a quarter of the elements.
    assert (normed == want).float().mean() > 0.99
    torch.testing.assert_close(normed, want, rtol=2e-3, atol=2e-3)


# ---- fp16 on the GPU at the model's shapes ---------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("pad_to_span", [False, True])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_fp16_gpu(pad_to_span, num_splits):
    gen = torch.Generator().manual_seed(11)
    lens = [1, 64, 700, 1024, 333]
    k_cache, v_cache, tables, dense = make_paged_kv(lens, 64, 2, 128, max_blocks=16, dtype=torch.float16, gen=gen)
    q = torch.randn(len(lens), 12, 128, generator=gen).half().to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = run_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5, num_splits, pad_to_span)
    want = attention_reference(q, dense, 128 ** -0.5)
    torch.testing.assert_close(got.double().cpu(), want, rtol=2e-3, atol=2e-3)


@gpu
def test_paged_attention_replays_in_cuda_graph():
    """Captured on other contents, replayed after every input changed in place: nothing was baked in at capture."""
    gen = torch.Generator().manual_seed(12)
    lens = [3, 64, 500, 129]
    k_cache, v_cache, tables, dense = make_paged_kv(lens, 64, 2, 128, max_blocks=8, dtype=torch.float16, gen=gen)
    real = [t.clone() for t in (k_cache, v_cache, tables)]
    k_cache.zero_()
    v_cache.zero_()
    tables.copy_(tables.flip(0))
    seq_lens = torch.ones(4, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(4, 12, 128, dtype=torch.float16, device=DEVICE)
    out = torch.empty_like(q)
    workspace = paged_attention_workspace(4, 12, 128, 4, DEVICE)
    for pad_to_span in (False, True):
        def call():
            paged_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5, num_splits=4,
                            pad_to_span=pad_to_span, out=out, workspace=workspace)
        call()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        for t, r in zip((k_cache, v_cache, tables), real):
            t.copy_(r)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(4, 12, 128, generator=gen).half())
        out.fill_(float("nan"))
        graph.replay()
        want = attention_reference(q, dense, 128 ** -0.5)
        torch.testing.assert_close(out.double().cpu(), want, rtol=2e-3, atol=2e-3)


@gpu
def test_rope_kv_fp16_gpu():
    gen = torch.Generator().manual_seed(13)
    tokens, head_dim = 40, 128
    qkv = torch.randn(tokens, 16 * head_dim, generator=gen).half().to(DEVICE)
    positions = torch.randint(32768, (tokens,), generator=gen)
    slots = torch.randperm(8 * 64, generator=gen)[:tokens]
    cos_sin = rope_cos_sin(head_dim, 32768, 1e6, DEVICE)
    k_cache = torch.zeros(8, 2, 64, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q_out, k_out = rope_kv(qkv, positions.to(DEVICE), cos_sin, k_cache, v_cache, slots.to(DEVICE))
    q, k, v = qkv.double().cpu().split([12 * head_dim, 2 * head_dim, 2 * head_dim], dim=1)
    cos, sin = cos_sin.double().cpu()[positions].chunk(2, dim=-1)
    torch.testing.assert_close(q_out.double().cpu(), rotate_half_reference(q.view(tokens, 12, head_dim), cos, sin),
                               rtol=1e-3, atol=2e-3)
    by_slot = lambda cache: cache.permute(0, 2, 1, 3).reshape(-1, 2, head_dim)[slots.to(DEVICE)]  # noqa: E731
    assert torch.equal(by_slot(k_cache), k_out)
    assert torch.equal(by_slot(v_cache).double().cpu(), v.view(tokens, 2, head_dim))


@pytest.mark.parametrize("rows, inter", [(3, 64), (2, 1500)])
def test_silu_mul_matches_reference(rows, inter):
    from servecap.engine.kernels import silu_mul
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs GPU tensors
    torch.testing.assert_close(silu_mul(gate_up.to(device)).double().cpu(), want, rtol=1e-5, atol=1e-6)


# ---- prefill attention ---------------------------------------------------------------------------------------

def pack_sequences(lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   gen: torch.Generator, *, gap: int = 0, tail: int = 0, row_pad: int = 0):
    """Packed q, k, v of sequences of these lengths, `gap` NaN rows after each and `tail` more at the end.

    k and v are column slices of wider [rows, (Hkv * D + row_pad)] buffers, so their rows are strided when
    row_pad > 0, as v is when it is sliced from the fused QKV output. Returns (q, k, v, seq_start).
    """
    starts = [sum(lens[:i]) + i * gap for i in range(len(lens))]
    rows = sum(lens) + len(lens) * gap + tail
    q = torch.full((rows, num_q_heads, head_dim), float("nan"), dtype=dtype)
    k, v = (torch.full((rows, num_kv_heads * head_dim + row_pad), float("nan"), dtype=dtype) for _ in range(2))
    for start, n in zip(starts, lens):
        q[start:start + n] = torch.randn(n, num_q_heads, head_dim, generator=gen).to(dtype)
        k[start:start + n] = torch.randn(n, num_kv_heads * head_dim + row_pad, generator=gen).to(dtype)
        v[start:start + n] = torch.randn(n, num_kv_heads * head_dim + row_pad, generator=gen).to(dtype)
    k, v = (t.to(DEVICE)[:, :num_kv_heads * head_dim].view(rows, num_kv_heads, head_dim) for t in (k, v))
    return q.to(DEVICE), k, v, torch.tensor(starts, dtype=torch.int32)


def causal_reference(q, k, v, starts, lens, scale) -> torch.Tensor:
    """float64 softmax(q k^T * scale + causal mask) v per sequence, query head h reading kv head h // group."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for start, n in zip(starts.tolist(), lens):
        qs, ks, vs = (t[start:start + n].double().cpu() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[start:start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out


def run_prefill(q, k, v, seq_start, lens, block_seq, block_q, scale, block_m=None):
    """One call into a NaN-poisoned out; int32 index tensors moved to the device."""
    out = torch.full_like(q, float("nan"))
    index = [torch.as_tensor(a, dtype=torch.int32).to(DEVICE) for a in (seq_start, lens, block_seq, block_q)]
    got = prefill_attention(q, k, v, *index, scale, out=out, block_m=block_m)
    assert got.data_ptr() == out.data_ptr()
    return out


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,tiles", [(4, 2, 16, 1), (3, 3, 32, 1), (12, 2, 16, 2)])
def test_prefill_attention_matches_reference(num_q_heads, num_kv_heads, head_dim, tiles):
    """Ragged sequences, empty ones, NaN between and after them, strided k and v, idle programs past the work.

    tiles = 2 doubles the query tile, so the diagonal spans two key tiles (the GPU's default ratio) and the
    queries at its start see none of the second one.
    """
    gen = torch.Generator().manual_seed(num_q_heads * 100 + head_dim)
    block_m = default_block_m(DEVICE) * tiles
    lens = [1, 5, 0, block_m, block_m + 1, 40, 0]
    q, k, v, starts = pack_sequences(lens, num_q_heads, num_kv_heads, head_dim, torch.float32, gen,
                                     gap=3, tail=9, row_pad=8)
    assert k.stride(0) == v.stride(0) == num_kv_heads * head_dim + 8
    work = plan(lens, block_m, max_programs(sum(lens), len(lens), block_m) + 2)
    assert (work.block_seq[-2:] == -1).all()
    scale = head_dim ** -0.5
    got = run_prefill(q, k, v, starts, lens, work.block_seq, work.block_q, scale, block_m).double().cpu()
    want = causal_reference(q, k, v, starts, lens, scale)
    covered = ~want.isnan()
    # Every row of a sequence was written and no other: the NaN gaps and tail still hold the poison.
    assert torch.equal(~got.isnan(), covered)
    torch.testing.assert_close(got[covered], want[covered], rtol=1e-5, atol=1e-5)


def test_prefill_attention_skips_idle_and_stale_programs():
    """-1 programs, tiles of an empty sequence and tiles past a sequence's end (a stale work list) do nothing."""
    gen = torch.Generator().manual_seed(5)
    block_m = default_block_m(DEVICE)
    lens = [block_m + 3, 0, 7]
    q, k, v, starts = pack_sequences(lens, 4, 2, 16, torch.float32, gen, tail=block_m)
    block_seq = [-1, 0, 1, 2, 0, -1, 2, 1]
    block_q = [0, block_m, 0, 0, 0, 5, block_m, block_m]
    got = run_prefill(q, k, v, starts, lens, block_seq, block_q, 0.25).double().cpu()
    want = causal_reference(q, k, v, starts, lens, 0.25)
    covered = ~want.isnan()
    assert torch.equal(~got.isnan(), covered)
    torch.testing.assert_close(got[covered], want[covered], rtol=1e-5, atol=1e-5)


def test_prefill_attention_alone_equals_packed():
    """A sequence's output does not depend on its neighbours or its place in the packed arrays."""
    gen = torch.Generator().manual_seed(6)
    block_m = default_block_m(DEVICE)
    lens = [9, 2 * block_m + 5, 3]
    q, k, v, starts = pack_sequences(lens, 4, 2, 16, torch.float32, gen)
    work = plan(lens, block_m)
    packed = run_prefill(q, k, v, starts, lens, work.block_seq, work.block_q, 0.25)
    rows = slice(int(starts[1]), int(starts[1]) + lens[1])
    alone_work = plan(lens[1:2], block_m)
    alone = run_prefill(q[rows].contiguous(), k[rows], v[rows], alone_work.seq_start, alone_work.seq_len,
                        alone_work.block_seq, alone_work.block_q, 0.25)
    assert torch.equal(alone, packed[rows])


def test_prefill_plan():
    work = plan([3, 0, 20, 8], block_m=8)
    assert work.seq_start.tolist() == [0, 3, 3, 23] and work.seq_len.tolist() == [3, 0, 20, 8]
    assert all(a.dtype == np.int32 for a in (work.seq_start, work.seq_len, work.block_seq, work.block_q))
    # Each tile once; the ones deepest into their sequence (most keys to read) first.
    assert list(zip(work.block_seq.tolist(), work.block_q.tolist())) == [(2, 16), (2, 8), (0, 0), (2, 0), (3, 0)]
    padded = plan([3, 0, 20, 8], block_m=8, num_programs=7)
    assert padded.block_seq.tolist()[5:] == [-1, -1] and padded.block_q.tolist()[5:] == [-1, -1]
    assert plan([3, 0, 20, 8], block_m=8, num_programs=5).block_seq.tolist() == work.block_seq.tolist()
    with pytest.raises(ValueError):
        plan([3, 0, 20, 8], block_m=8, num_programs=4)
    with pytest.raises(ValueError):
        plan([3, -1], block_m=8)
    empty = plan([], block_m=8, num_programs=2)
    assert empty.seq_len.size == 0 and empty.block_seq.tolist() == [-1, -1]


@pytest.mark.parametrize("block_m", [1, 3, 4])
def test_prefill_max_programs_is_the_worst_split(block_m):
    """The bound equals the most tiles over every split of T tokens into at most S sequences."""
    def splits(tokens: int, seqs: int):
        if seqs == 1:
            yield [tokens]
            return
        for first in range(tokens + 1):
            for rest in splits(tokens - first, seqs - 1):
                yield [first] + rest
    for tokens in range(11):
        for seqs in range(1, 5):
            worst = max(len(plan(lens, block_m).block_seq) for lens in splits(tokens, seqs))
            assert max_programs(tokens, seqs, block_m) == worst, (tokens, seqs)


def sdpa_reference(q, k, v, starts, lens, scale) -> torch.Tensor:
    """torch SDPA per sequence in float32 (causal, GQA); rows outside every sequence are NaN."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    for start, n in zip(starts, lens):
        if n:
            qs, ks, vs = (t[start:start + n].float().transpose(0, 1)[None] for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                 enable_gqa=True)
            out[start:start + n] = o[0].transpose(0, 1)
    return out


def fused_qkv(tokens: int, gen: torch.Generator):
    """q (contiguous) and k, v (column slices of the fused projection's output) at the model's shapes, fp16."""
    qkv = torch.randn(tokens, 16 * 128, generator=gen).half().to(DEVICE)
    q = qkv[:, :12 * 128].reshape(tokens, 12, 128).contiguous()
    k = qkv[:, 12 * 128:14 * 128].view(tokens, 2, 128)
    v = qkv[:, 14 * 128:].view(tokens, 2, 128)
    return q, k, v


@pytest.mark.gpu
def test_prefill_attention_fp16_gpu():
    gen = torch.Generator().manual_seed(14)
    lens = [1, 127, 128, 129, 0, 1000, 4096, 2500]
    tokens = sum(lens) + 77  # a token bucket's padding after the real tokens
    q, k, v = fused_qkv(tokens, gen)
    block_m = default_block_m(DEVICE)
    work = plan(lens, block_m, max_programs(tokens, len(lens) + 2, block_m))
    out = run_prefill(q, k, v, work.seq_start, lens, work.block_seq, work.block_q, 128 ** -0.5)
    want = sdpa_reference(q, k, v, work.seq_start.tolist(), lens, 128 ** -0.5)
    assert out[sum(lens):].isnan().all(), "wrote into the padding"
    torch.testing.assert_close(out[:sum(lens)].float(), want[:sum(lens)], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_prefill_attention_replays_in_cuda_graph():
    """Captured once for a token bucket and a sequence count with an idle work list, replayed for two splits."""
    gen = torch.Generator().manual_seed(15)
    tokens, max_seqs, block_m = 2048, 6, default_block_m(DEVICE)
    num_programs = max_programs(tokens, max_seqs, block_m)
    q, k, v = fused_qkv(tokens, gen)
    seq_start, seq_len = (torch.zeros(max_seqs, dtype=torch.int32, device=DEVICE) for _ in range(2))
    block_seq, block_q = (torch.full((num_programs,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2))
    out = torch.empty_like(q)

    def call():
        prefill_attention(q, k, v, seq_start, seq_len, block_seq, block_q, 128 ** -0.5, out=out)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()

    # Many short sequences use every program; a long one and a gap of padding use few.
    for lens in ([1, 129, 129, 129, 129, 1531], [2000, 0, 7]):
        work = plan(lens, block_m, num_programs)
        if lens[0] == 1:
            assert (work.block_seq >= 0).all()
        for buf, arr in ((seq_start, work.seq_start), (seq_len, work.seq_len), (block_seq, work.block_seq),
                         (block_q, work.block_q)):
            buf[:len(arr)].copy_(torch.from_numpy(arr))
        new_q, new_k, new_v = fused_qkv(tokens, gen)
        q.copy_(new_q)
        k.copy_(new_k)
        v.copy_(new_v)
        out.fill_(float("nan"))
        graph.replay()
        want = sdpa_reference(q, k, v, work.seq_start.tolist(), lens, 128 ** -0.5)
        assert torch.equal(out.isnan(), want.isnan()), "wrote outside the sequences or missed a row"
        covered = ~want.isnan()
        torch.testing.assert_close(out.float()[covered], want[covered], rtol=2e-3, atol=2e-3)


def test_prefill_attention_of_a_chunk_reads_its_prefix_from_the_pool():
    """A prompt prefilled in chunks: the last chunk's queries over the earlier positions in the paged pool and the
    chunk's own keys equal the same queries of the whole prompt attended at once."""
    gen = torch.Generator().manual_seed(26)
    hq, hkv, d, page = 4, 2, 16, 16
    whole, chunk = 70, 23  # a prefix of 47: two full pages and part of a third
    prefix = whole - chunk
    q, k, v, starts = pack_sequences([whole], hq, hkv, d, torch.float32, gen)
    want = causal_reference(q, k, v, starts, [whole], d ** -0.5)[prefix:]
    blocks = [3, 0, 5]  # the prompt's block table, out of order on purpose
    k_cache = torch.full((6, hkv, page, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for pos in range(prefix):
        k_cache[blocks[pos // page], :, pos % page] = k[pos].cpu()
        v_cache[blocks[pos // page], :, pos % page] = v[pos].cpu()
    p = plan([chunk], default_block_m(DEVICE))
    idx = [torch.from_numpy(a).to(DEVICE) for a in (p.seq_start, p.seq_len, p.block_seq, p.block_q)]
    got = prefill_attention(q[prefix:].contiguous(), k[prefix:].contiguous(), v[prefix:].contiguous(), *idx,
                            d ** -0.5, prefix_len=torch.tensor([prefix], dtype=torch.int32, device=DEVICE),
                            block_tables=torch.tensor([blocks + [0]], dtype=torch.int32, device=DEVICE),
                            k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE))
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
