"""How much of a trace's prompts repeat, from its requests' hash ids (workload.Request): what a prefix cache could
reuse at best. Requests without hash ids share nothing here (nothing says they do)."""
from __future__ import annotations

from typing import Iterable

from .workload import Request


def repeated_block_share(requests: Iterable[Request]) -> float:
    """The share of hashed prompt blocks whose id an earlier request already had (0 when no request has hash ids).
    Ids are chained, so a repeated block repeats every block before it too."""
    seen: set[int] = set()
    repeated = total = 0
    for r in requests:
        repeated += sum(h in seen for h in r.hash_ids)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return repeated / total if total else 0.0


def cached_prefix_share(requests: Iterable[Request], block: int) -> float:
    """The share of all prompt tokens an unbounded prefix cache of full `block`-token blocks would hold when each
    request arrives, requests in order and each cached once it has arrived: per request, the longest run of leading
    hash ids an earlier request had, in tokens (the prompt's own when that run takes in its last, partial block),
    rounded down to whole blocks. An upper bound: a real cache evicts, and recomputes at least a prompt's last
    token."""
    if block < 1:
        raise ValueError(f"a cache block is a number of tokens >= 1, got {block}")
    seen: set[int] = set()
    cached = total = 0
    for r in requests:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        cached += min(k * r.hash_block, r.prompt_tokens) // block * block
        total += r.prompt_tokens
        seen.update(r.hash_ids)
    return cached / total if total else 0.0
