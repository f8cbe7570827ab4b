"""The KV block pool's bookkeeping, and the only block arithmetic: tokens to blocks, GiB to blocks, and the size
of a pool that never binds.

Only ids live here; the engine's KV tensors are indexed by these ids, the simulator has none. The free list
is lazy (ids never handed out are a counter), so a pool's cost does not grow with its size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from servecap.traces.errors import InputError
from servecap.traces.model_spec import DEFAULT_BLOCK_SIZE


def blocks_for(tokens: int, block_size: int) -> int:
    """Whole blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


def blocks_for_gib(gib: float, block_size: int, kv_bytes_per_token: int) -> int:
    """How many blocks a pool of `gib` GiB holds (callers check that gib is a positive number)."""
    return int(gib * 2**30 // (block_size * kv_bytes_per_token))


def gib_of(blocks: int, block_size: int, kv_bytes_per_token: int) -> float:
    return blocks * block_size * kv_bytes_per_token / 2**30


def largest_request_tokens(requests: Iterable) -> int:
    """Prompt + full budget of the largest request: what it reserves, in tokens."""
    return max(r.prompt_tokens + r.budget for r in requests)


def unbounded_pool(max_batch: int, largest_tokens: int, block_size: int) -> int:
    """Blocks for max_batch copies of the largest request: admission then never waits on the pool."""
    return max_batch * blocks_for(largest_tokens, block_size)


@dataclass(frozen=True)
class PoolSize:
    """A KV pool's size as given: GiB of memory, a number of blocks, or neither (unbounded: enough that admission
    never waits on the pool). Turned into blocks only here (num_blocks), for one block size and K/V width."""

    gib: float | None = None
    blocks: int | None = None

    def __post_init__(self):
        if self.gib is not None and self.blocks is not None:
            raise InputError("a pool is given in GiB or in blocks, not both")
        if self.gib is not None and not self.gib > 0:
            raise InputError(f"a pool of {self.gib!r} GiB: the size must be a positive number")
        if self.blocks is not None and (isinstance(self.blocks, bool) or not isinstance(self.blocks, int)
                                        or self.blocks < 1):
            raise InputError(f"a pool of {self.blocks!r} blocks: the size must be a whole number >= 1")

    @property
    def unbounded(self) -> bool:
        return self.gib is None and self.blocks is None

    def num_blocks(self, block_size: int, kv_bytes_per_token: int, max_batch: int, largest_tokens: int) -> int:
        """The pool's blocks; unbounded: max_batch copies of a request of `largest_tokens` tokens."""
        if self.gib is not None:
            return blocks_for_gib(self.gib, block_size, kv_bytes_per_token)
        if self.blocks is not None:
            return self.blocks
        return unbounded_pool(max_batch, largest_tokens, block_size)

    def describe(self, max_batch: int) -> str:
        """How the blocks were chosen, for a run's printout."""
        if self.gib is not None:
            return f"{self.gib:g} GiB"
        if self.blocks is not None:
            return "as given"
        return f"never binds: {max_batch} x the largest request"

    def __str__(self) -> str:
        return f"{self.gib:g} GiB" if self.gib is not None else \
            f"{self.blocks} blocks" if self.blocks is not None else "unbounded"


UNBOUNDED = PoolSize()


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
