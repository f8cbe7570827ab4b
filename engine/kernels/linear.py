"""Matrix products of decode steps: a few rows (at most 32) against a large fp16 weight, split over K.

At decode's row counts a product is a read of the weight, and cuBLAS leaves bandwidth unused on the thin
shapes of a 1.5B model. Here each program reads a BLOCK_N x (K / SPLIT_K) slice of the weight, so a thin
matrix still spreads over the whole GPU, and the last program of an N tile to finish sums the tile's partials
in split order (deterministic, one launch, nothing to zero: it resets its counter for the next call). The down
projection also takes SiLU(gate) * up of the gate/up output as its input, one launch fewer per layer.

Configurations are measured per GPU and weight shape by `python -m engine.kernels.tune_linear` into
linear_configs.json; a shape without one, or more rows than a tile, goes to cuBLAS.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_mul as silu_mul_kernel

CONFIGS = Path(__file__).with_name("linear_configs.json")
MAX_ROWS = 32
_COUNTERS = 1 << 14  # split-K tile counters, shared by every launch on a device (they run one after another)


class Config(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _linear_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, a_stride, out_stride,
                   SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_blocks)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_off = offs_m[:, None] * a_stride + offs_k[None, :]
        a = tl.load(a_ptr + a_off, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if SILU_MUL:  # a row is [gate | up]; rounded as HF's act_fn(gate) * up is, in the input dtype
            up = tl.load(a_ptr + a_off + K, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            g = a.to(tl.float32)
            act = (g * tl.sigmoid(g)).to(a.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(a.dtype)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w))

    offs_t = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    done = True
    if SPLIT_K > 1:
        tile = part_ptr + pid_n * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile + pid_k * (BLOCK_M * BLOCK_N) + offs_t, acc)
        # acq_rel: this program's partial is visible before its count, and the last one sees every partial.
        done = tl.atomic_add(count_ptr + pid_n, 1) == SPLIT_K - 1
        if done:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(tile + s * (BLOCK_M * BLOCK_N) + offs_t, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
    if done:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * out_stride + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


@lru_cache(maxsize=None)
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(_COUNTERS, dtype=torch.int32, device=device)


def block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def linear_triton(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: Config, *,
                  silu_mul: bool = False) -> torch.Tensor:
    """a [M, K] (or [M, 2K] with silu_mul: SiLU(a[:, :K]) * a[:, K:]) @ w[N, K]^T (+ bias), M <= MAX_ROWS."""
    m = a.shape[0]
    n, k = w.shape
    assert m <= MAX_ROWS and a.stride(1) == 1 and w.is_contiguous() and a.shape[1] == (2 * k if silu_mul else k)
    bm = block_m(m)
    tiles = triton.cdiv(n, cfg.block_n)
    assert tiles <= _COUNTERS
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    part = torch.empty((tiles, cfg.split_k, bm, cfg.block_n), dtype=torch.float32, device=a.device) \
        if cfg.split_k > 1 else out
    _linear_kernel[(tiles, cfg.split_k)](
        a, w, bias if bias is not None else w, out, part, _counters(a.device), m, n, k, a.stride(0), out.stride(0),
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK_M=bm, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@lru_cache(maxsize=None)
def _table(device_name: str) -> dict[str, Config | None]:
    if not CONFIGS.exists():
        return {}
    entries = json.loads(CONFIGS.read_text()).get("devices", {}).get(device_name, {})
    return {key: Config(*c) if c else None for key, c in entries.items()}


def identity(device_name: str, tuned: bool = True) -> str:
    """What decode's products run on this GPU, for records: 'cublas', or 'split-k:' and a hash of the configurations."""
    entries = _table(device_name) if tuned else {}
    if not any(entries.values()):
        return "cublas"
    blob = json.dumps({k: v for k, v in sorted(entries.items())}, sort_keys=True).encode()
    return "split-k:" + hashlib.sha256(blob).hexdigest()[:12]


def config_key(n: int, k: int, bm: int, silu_mul: bool) -> str:
    return f"{n}x{k}/m{bm}" + ("/silu" if silu_mul else "")


def find_config(a: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> Config | None:
    if a.device.type != "cuda" or a.shape[0] > MAX_ROWS or a.dtype != torch.float16:
        return None
    return _table(torch.cuda.get_device_name(a.device)).get(config_key(*w.shape, block_m(a.shape[0]), silu_mul))


def torch_linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 silu_mul: bool = False) -> torch.Tensor:
    """F.linear(a, w, bias); with silu_mul, `a` is the gate/up output and SiLU(gate) * up is the product's input."""
    return F.linear(silu_mul_kernel(a) if silu_mul else a, w, bias)


def linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           silu_mul: bool = False) -> torch.Tensor:
    """torch_linear's product, through the split-K kernel where this GPU has a measured configuration for the
    shape and row tile, else through torch (cuBLAS)."""
    cfg = find_config(a, w, silu_mul)
    if cfg is not None:
        return linear_triton(a, w, bias, cfg, silu_mul=silu_mul)
    return torch_linear(a, w, bias, silu_mul=silu_mul)
