"""RMSNorm, alone or fused with the residual add before it; one program per row.

Matches HF's Qwen2RMSNorm: normalize in fp32, cast to the input dtype, then multiply by the weight in that dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride, out_stride,
                     res_out_stride, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if ADD:
        # Added in the input dtype, as `residual + hidden_states` is in the model, so the residual stream matches.
        x += tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * res_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)  # exact in fp32, so one rounding: x's dtype product
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    n_cols = x.shape[-1]
    tensors = [t for t in (x, residual, out, residual_out) if t is not None]
    assert all(t.dim() == 2 and t.stride(1) == 1 for t in tensors) and weight.is_contiguous()
    block = triton.next_power_of_2(n_cols)
    res, res_out = (residual, residual_out) if residual is not None else (x, out)  # unread, unwritten
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, res_out, n_cols, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), eps,
        ADD=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalize(x) for x [N, H] (rows may be strided, each row contiguous). `out` may be x itself."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). Each row is read whole before it is written, so `out` may be x and
    `residual_out` may be residual: the in-place form that keeps a CUDA graph's buffers static."""
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
