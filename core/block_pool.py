"""The KV block pool's bookkeeping, and every sizing of a pool: from GiB, for one request, for a whole trace.

Only ids live here; the engine's KV tensors are indexed by these ids, the simulator has none. The free list
is lazy (ids never handed out are a counter), so a pool's cost does not grow with its size.
"""
from __future__ import annotations

from typing import Iterable

from traces.model_spec import QWEN25_1P5B, kv_bytes_per_token

DEFAULT_BLOCK_SIZE = 64
QWEN_KV_BYTES_PER_TOKEN = kv_bytes_per_token(QWEN25_1P5B)  # fp16


def blocks_for(tokens: int, block_size: int) -> int:
    """Whole blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


def blocks_for_gib(gib: float, block_size: int = DEFAULT_BLOCK_SIZE,
                   kv_bytes_per_token: int = QWEN_KV_BYTES_PER_TOKEN) -> int:
    """How many blocks a pool of `gib` GiB holds (callers check that gib is a positive number)."""
    return int(gib * 2**30 // (block_size * kv_bytes_per_token))


def gib_of(blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, kv_bytes_per_token: int = QWEN_KV_BYTES_PER_TOKEN) -> float:
    return blocks * block_size * kv_bytes_per_token / 2**30


def largest_request_blocks(requests: Iterable, block_size: int) -> int:
    """Blocks the largest request (prompt + full budget) reserves."""
    return blocks_for(max(r.prompt_tokens + r.budget for r in requests), block_size)  # rounding up keeps the order


def unbounded_pool(requests: Iterable, max_batch: int, block_size: int) -> int:
    """Blocks for max_batch copies of the largest request: admission then never waits on the pool."""
    return max_batch * largest_request_blocks(requests, block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"a pool needs positive blocks and block size, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._fresh = 0  # ids below this have been handed out at least once
        # Released ids are handed out again oldest first: a FIFO kept as a list read from _head, so that a request's
        # dozens of blocks are one slice rather than a pop each.
        self._released: list[int] = []
        self._head = 0
        self.free = num_blocks

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)  # blocks_for(), inlined: the scheduler asks several times a pass

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"asked for {n} blocks with {self.free} free")  # the scheduler checks first
        fresh = min(n, self.num_blocks - self._fresh)
        out = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        if n > fresh:
            head = self._head + n - fresh
            out += self._released[self._head:head]
            if 2 * head > len(self._released):  # drop the handed-out front once it is most of the list
                del self._released[:head]
                head = 0
            self._head = head
        self.free -= n
        return out

    def release(self, blocks: list[int]) -> None:
        self._released.extend(blocks)
        self.free += len(blocks)
