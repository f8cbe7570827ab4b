"""The workload's prompts as fixed token-id sequences.

Token ids come straight from PCG64's raw 64-bit output, which NumPy guarantees is the same on every
platform and version (the distribution methods on top of it are not), so every machine builds the
same prompts.
"""
from __future__ import annotations

import numpy as np

PROMPT_LENGTHS = {"p16": 16, "p256": 256, "p1024": 1024, "p2048": 2048, "p4096": 4096}
PROMPT_NAMES = tuple(PROMPT_LENGTHS)
PROMPT_SEED = 0
# Qwen2.5's ordinary vocabulary ends here; ids above are special tokens we keep out of prompts.
QWEN_TEXT_VOCAB = 151643


def prompt_tokens(length: int, vocab: int = QWEN_TEXT_VOCAB, seed: int = PROMPT_SEED) -> list[int]:
    """The token ids of the prompt of `length` tokens (every length has its own fixed sequence)."""
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    raw = np.random.PCG64(np.random.SeedSequence([seed, length])).random_raw(length)
    return (raw % np.uint64(vocab)).astype(np.int64).tolist()
