"""The model's configuration and weights, through HF transformers.

Weights come from a local checkpoint directory (config.json + safetensors) when one is given, or are
seeded random weights of the exact configuration otherwise: step costs depend on shapes, not values.
The HF model built here is also the reference decode the parity gate checks against.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernels  # noqa: F401  first: on a CPU it must set TRITON_INTERPRET before transformers imports triton
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from servecap.traces.errors import InputError
from servecap.traces.model_spec import QWEN25_1P5B, SHAPE_KEYS, config_hash


def hf_config(spec: dict) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"], num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"], rms_norm_eps=spec["rms_norm_eps"],
        tie_word_embeddings=spec["tie_word_embeddings"], initializer_range=spec.get("initializer_range", 0.02),
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        attn_implementation="sdpa")


def spec_of(config: Qwen2Config, name: str) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    return {"name": name, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
            "tie_word_embeddings": bool(config.tie_word_embeddings),
            "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings}


@dataclass
class LoadedModel:
    hf: Qwen2ForCausalLM
    spec: dict
    weights: str  # what the records say about the weights: "random(seed=0)" or "checkpoint:<dir>"

    @property
    def config_hash(self) -> str:
        return config_hash(self.spec)


def load_model(checkpoint: str | Path | None = None, spec: dict = QWEN25_1P5B, seed: int = 0,
               dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda") -> LoadedModel:
    """The HF model on `device` in `dtype`: from a local checkpoint, or seeded random weights of `spec`."""
    if checkpoint is not None:
        path = Path(checkpoint)
        if not (path / "config.json").exists():
            raise InputError("not a checkpoint directory (no config.json); weights cannot be downloaded at run time",
                             path=path)
        hf = Qwen2ForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
        loaded = spec_of(hf.config, path.name)
        if spec is not None:
            diff = {k: (loaded[k], spec[k]) for k in SHAPE_KEYS if loaded[k] != spec[k]}
            if diff:
                raise InputError(f"checkpoint shapes differ from {spec['name']}: {diff}", path=path)
        return LoadedModel(hf.eval(), loaded, f"checkpoint:{path.resolve()}")
    torch.manual_seed(seed)
    with torch.device(device):
        hf = Qwen2ForCausalLM(hf_config(spec))
    return LoadedModel(cast_weights(hf, dtype).eval(), dict(spec), f"random(seed={seed})")


def cast_weights(hf: Qwen2ForCausalLM, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """hf with its weights in `dtype` and its float buffers as built: in float32, as from_pretrained leaves them.

    `Module.to(dtype)` casts every floating buffer too, and the one a Qwen2 has is RoPE's inv_freq: in fp16 its
    64 frequencies (1 down to 1e6 ** -(126/128) ~ 1.2e-6, deep in fp16's subnormals) are off by up to 0.9%, so
    the angle pos * inv_freq drifts by up to 0.7 rad at position 4095 and HF's attention over a long prompt is not
    Qwen2's (results/engine/parity-fp32/CAUSE.md). A later .float() cannot undo the rounding.
    """
    buffers = {name: b.clone() for name, b in hf.named_buffers() if b.is_floating_point()}
    hf = hf.to(dtype)
    for name, b in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(owner), leaf, b)  # a registered buffer's name: replaces the buffer, keeps its flags
    return hf
