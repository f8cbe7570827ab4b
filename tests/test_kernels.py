"""The Triton kernels against float64 torch references.

Without CUDA, importing engine.kernels switches Triton to its interpreter, so these run on the CPU in float32 on
small shapes; with CUDA the same tests run compiled on the GPU, plus fp16 ones at the model's shapes.
Outputs and caches are filled with NaN before each call: every element that should be written must be, and
nothing else may be.
"""
from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import (add_rms_norm, default_num_splits, paged_attention, paged_attention_workspace,
                            rms_norm, rope_cos_sin, rope_kv)

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
    from engine.kernels import silu_mul
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs GPU tensors
    torch.testing.assert_close(silu_mul(gate_up.to(device)).double().cpu(), want, rtol=1e-5, atol=1e-6)
