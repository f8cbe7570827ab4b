"""A request's prompt as the token ids the engine prefills: from its blocks' hash ids where the trace has them, else
the fixed prompt of its length (servecap/traces/prompts.py)."""
from __future__ import annotations

import numpy as np

from .prompts import PROMPT_SEED, QWEN_TEXT_VOCAB, prompt_tokens
from .workload import Request

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
