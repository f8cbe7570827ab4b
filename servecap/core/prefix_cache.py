"""Automatic prefix caching (vLLM's, in nano-vllm's compact form): full prompt blocks addressed by the hash of
their content and everything before it, shared by reference count, and kept after their last user leaves until
a new block is needed (least recently released first).

A request's prompt blocks are known from its trace's hash ids (Request.hash_ids, one per hash_block tokens, as
Mooncake's traces give them): a pool block of B tokens inside hashed block h is keyed by the chain of the keys
before it, h's id and its place in h. So two requests share a pool block exactly when their prompts agree up to
its end, whether or not the trace's own ids are chained. A request without hash ids has no keys and is never
cached: nothing says its tokens repeat. Generated tokens are never cached.

How cached blocks count: a block held by several running requests is one block of the pool; a cached block no
request holds counts as free (it is evicted when a new block is needed, so admission never waits on it), and a
request that takes it makes it held, as a new block would be. Under reserve-on-admit a request's reservation is
its prompt and budget less the blocks it shares; under on-demand, the uncached part of what it computes now.
"""
from __future__ import annotations

from collections import OrderedDict

from servecap.traces.workload import Request

from .block_pool import BlockPool


def block_keys(req: Request, block_size: int) -> list[int]:
    """The keys of the request's full prompt blocks, in order ([] without hashes, or when a hashed block is not a
    whole number of pool blocks)."""
    h = req.hash_block
    if not req.hash_ids or h <= 0 or h % block_size:
        return []
    per = h // block_size
    keys, key = [], 0
    for j in range(min(req.prompt_tokens // block_size, len(req.hash_ids) * per)):
        key = hash((key, req.hash_ids[j // per], j % per))
        keys.append(key)
    return keys


class CachingBlockPool(BlockPool):
    """A block pool whose full prompt blocks stay addressable by key while any request holds them and, once none
    does, until they are evicted. `free` counts the evictable ones."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.refs: dict[int, int] = {}  # held cached blocks: how many requests hold each
        self.key_of: dict[int, int] = {}  # cached blocks (held or not): their key
        self.block_of: dict[int, int] = {}  # key: its cached block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no one holds, least recent first
        self.hits = self.lookups = 0  # blocks found, blocks asked for (hit rate)

    def match(self, keys: list[int], most: int) -> list[int]:
        """The cached blocks of the longest prefix of `keys`, at most `most` of them (not taken yet)."""
        out = []
        for key in keys[:most]:
            b = self.block_of.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def taken_from_free(self, blocks: list[int]) -> int:
        """How many of these cached blocks no one holds now (taking them uses free blocks)."""
        return sum(1 for b in blocks if b in self.evictable)

    def take(self, blocks: list[int], asked: int) -> None:
        """Hold cached blocks (a prefix hit); `asked`: the blocks the request looked up, for the hit rate."""
        self.lookups += asked
        self.hits += len(blocks)
        for b in blocks:
            if b in self.evictable:
                del self.evictable[b]
                self.free -= 1
                self.refs[b] = 1
            else:
                self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"asked for {n} blocks with {self.free} free")
        fresh = min(n, self.free - len(self.evictable))  # never-cached free blocks first
        out = super().allocate(fresh) if fresh else []
        for _ in range(n - fresh):  # then evict, least recently released first
            b, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
            self.free -= 1
            out.append(b)
        return out

    def cache(self, block: int, key: int) -> None:
        """A held block now holds the full prompt block `key`: address it (unless another block already does)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key
            self.refs[block] = 1

    def release(self, blocks: list[int]) -> None:
        plain = []
        for b in blocks:
            if b in self.key_of:
                r = self.refs[b] - 1
                if r:
                    self.refs[b] = r
                else:
                    del self.refs[b]
                    self.evictable[b] = None
                    self.free += 1
            else:
                plain.append(b)
        if plain:
            super().release(plain)
