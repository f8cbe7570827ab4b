"""SiLU(gate) * up in one pass over the fused gate/up projection's output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Rounded to the input dtype before the product, as HF's act_fn(gate_proj(x)) * up_proj(x) is.
    act = (g * tl.sigmoid(g)).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2 * I] holding gate in its first I columns and up in the rest."""
    n, two_i = gate_up.shape
    assert gate_up.stride(1) == 1 and two_i % 2 == 0
    out = torch.empty((n, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(n, triton.cdiv(two_i // 2, BLOCK))](gate_up, out, two_i // 2, gate_up.stride(0), out.stride(0),
                                                          BLOCK=BLOCK, num_warps=4)
    return out
