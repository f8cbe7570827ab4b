"""The KV block pool's bookkeeping: fixed-size blocks handed out from a free list.

Only ids live here; the engine's KV tensors are indexed by these ids, the simulator has none.
"""
from __future__ import annotations

from collections import deque

from traces.model_spec import QWEN25_1P5B, kv_bytes_per_token

DEFAULT_BLOCK_SIZE = 64
QWEN_KV_BYTES_PER_TOKEN = kv_bytes_per_token(QWEN25_1P5B)  # 28,672 bytes in fp16


def blocks_for_gib(gib: float, block_size: int = DEFAULT_BLOCK_SIZE,
                   kv_bytes_per_token: int = QWEN_KV_BYTES_PER_TOKEN) -> int:
    """How many blocks a pool of `gib` GiB holds (0.5 GiB of Qwen2.5-1.5B KV = 292 blocks of 64 tokens)."""
    if not gib > 0:
        raise ValueError(f"pool size must be positive, got {gib} GiB")
    return int(gib * 2**30 // (block_size * kv_bytes_per_token))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"a pool needs positive blocks and block size, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")  # the scheduler checks first
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
