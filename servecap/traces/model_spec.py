"""The model a cost table or run belongs to, identified by a hash of the shapes that set its costs."""
from __future__ import annotations

import hashlib
import json

# Qwen2.5-1.5B (docs/DESIGN.md). Costs depend on these shapes, not on the weights' values.
QWEN25_1P5B = {
    "name": "Qwen2.5-1.5B",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings")


def config_hash(spec: dict) -> str:
    """Hash of the cost-relevant shapes: two configs with the same hash cost the same per step."""
    return hashlib.sha256(json.dumps({k: spec[k] for k in SHAPE_KEYS}, sort_keys=True).encode()).hexdigest()[:12]


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


DEFAULT_BLOCK_SIZE = 64  # tokens per KV block: the engine's pool, and the unit a prefix cache reuses


def kv_bytes_per_token(spec: dict, dtype: str) -> int:
    """Bytes of K and V one token holds in the pool, over every layer."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPE_BYTES)}")
    return spec["num_hidden_layers"] * 2 * spec["num_key_value_heads"] * spec["head_dim"] * DTYPE_BYTES[dtype]


def parameter_count(spec: dict) -> int:
    """The weights of a Qwen2 of these shapes: embeddings (and an untied head), attention with q/k/v biases, the
    gated MLP and the norms."""
    h, q, kv = spec["hidden_size"], spec["num_attention_heads"] * spec["head_dim"], \
        spec["num_key_value_heads"] * spec["head_dim"]
    layer = h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * spec["intermediate_size"] + 2 * h
    embed = spec["vocab_size"] * h * (1 if spec["tie_word_embeddings"] else 2)
    return embed + spec["num_hidden_layers"] * layer + h

# A two-layer Qwen2 of the same structure (GQA, biases, RoPE) for CPU tests and demos. Untied and with
# a wide init so that its greedy tokens depend on the context, which makes token parity a real check.
TINY_QWEN2 = dict(QWEN25_1P5B, name="tiny-qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2)
DEFAULT_MODEL = "qwen2.5-1.5b"  # what the engine serves unless told otherwise
MODELS = {DEFAULT_MODEL: QWEN25_1P5B, "tiny": TINY_QWEN2}
