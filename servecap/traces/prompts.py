"""The workload's prompts as fixed token-id sequences.

Token ids come straight from PCG64's raw 64-bit output, which NumPy guarantees is the same on every
platform and version (the distribution methods on top of it are not), so every machine builds the
same prompts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # workload imports this module's prompt lengths
    from .workload import Request

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



# Hash id h's block is seeded by the words (PROMPT_SEED, HASH_STREAM, h, 1). SeedSequence reads trailing zero words as
# absent ([0, 1, 0] seeds what [0, 1] does): the closing 1 keeps every id's words apart from every other id's, from
# the prompts' (PROMPT_SEED, length) and from the workload draws' (seed, stream).
HASH_STREAM = 1


def request_token_ids(req: Request, vocab: int) -> np.ndarray:
    """The int32 token ids of a request's prompt (req.prompt_tokens of them) over the first min(vocab,
    QWEN_TEXT_VOCAB) ids.

    Without hash ids, the ids the engine has always prefilled: prompt_tokens of the prompt's length. With them, block
    i is a function of hash_ids[i] alone (and of the position inside the block), so requests whose hashes say they
    share a prefix get the same tokens for it, and different ids give (almost surely) different blocks; a last,
    partial block takes the first tokens of its id's full block.
    """
    vocab = min(vocab, QWEN_TEXT_VOCAB)
    if not req.hash_ids:
        return np.asarray(prompt_tokens(req.prompt_tokens, vocab), dtype=np.int32)
    block = req.hash_block
    out = np.empty(len(req.hash_ids) * block, dtype=np.int32)
    for i, h in enumerate(req.hash_ids):
        raw = np.random.PCG64(np.random.SeedSequence([PROMPT_SEED, HASH_STREAM, h, 1])).random_raw(block)
        out[i * block:(i + 1) * block] = raw % np.uint64(vocab)
    return out[:req.prompt_tokens]
