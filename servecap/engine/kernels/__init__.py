"""Triton kernels for the engine's decode and prefill steps.

Without a CUDA device the kernels run under Triton's interpreter, so the engine and its tests work on a CPU
machine. Triton reads the switch when it is first imported, hence here, before anything of ours imports it.
"""
import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:  # too late: its own helpers (tl.sum, ...) were built for compiled mode
        raise ImportError("without CUDA, import engine.kernels before triton (transformers imports it)")
    os.environ["TRITON_INTERPRET"] = "1"

from .activation import silu_mul  # noqa: E402
from .paged_attention import default_num_splits, paged_attention, paged_attention_workspace  # noqa: E402
from .prefill_attention import default_block_m, max_programs, plan, prefill_attention  # noqa: E402
from .rmsnorm import add_rms_norm, rms_norm  # noqa: E402
from .rope_kv import rope_cos_sin, rope_kv  # noqa: E402

__all__ = ["paged_attention", "paged_attention_workspace", "default_num_splits",
           "prefill_attention", "default_block_m", "max_programs", "plan",
           "rope_kv", "rope_cos_sin", "rms_norm", "add_rms_norm", "silu_mul"]
