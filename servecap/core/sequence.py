"""A request inside the engine (Seq). Its own module so that the prefill policies, which the scheduler imports, can
name the sequences they choose from without importing the scheduler."""
from __future__ import annotations

import math

from servecap.traces.workload import Request


class Seq:
    """A request inside the engine: its blocks, progress and the times the records need."""

    __slots__ = ("req", "budget", "blocks_needed", "block_table", "kv_len", "generated", "admitted", "admit_step",
                 "group_id", "group_size", "first_token", "last_token", "finished", "token_times", "token_ids",
                 "prefilling", "preemptions", "recomputed", "peak", "cached", "keys")

    def __init__(self, req: Request, blocks_needed: int):
        self.req = req
        self.budget = req.budget  # the request's, at hand: the scheduler compares it with every row every pass
        self.blocks_needed = blocks_needed
        self.block_table: list[int] = []
        self.kv_len = 0  # tokens whose K/V are in the pool: the prompt's computed part, then one per decode step
        self.generated = 0
        self.admitted = self.first_token = self.last_token = self.finished = math.nan
        self.admit_step = self.group_id = self.group_size = -1
        self.token_times: list[float] = []
        self.token_ids: list[int] = []
        self.prefilling = False  # admitted, its target positions not yet all in the pool
        self.preemptions = 0
        self.recomputed = 0  # positions whose K/V were computed, lost to a preemption, and computed again
        self.peak = 0  # the most positions it had in the pool before its last preemption
        self.cached = 0  # prompt positions found in the prefix cache at admission
        self.keys: list[int] = []  # its full prompt blocks' cache keys (prefix caching; servecap/core/prefix_cache.py)

    @property
    def remaining(self) -> int:
        return self.budget - self.generated

    @property
    def target(self) -> int:
        """Positions in the pool once this sequence has its next token's inputs: prompt + generated tokens."""
        return self.req.prompt_tokens + self.generated
