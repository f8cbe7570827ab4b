"""The scheduler both clocks share: FIFO queue, batch rows, reserve-on-admit, admission groups, retirement.

The engine drives it with real GPU steps and the simulator with modelled step costs; neither has
scheduling code of its own, so they cannot disagree about who is admitted when.

Rules (DESIGN.md): the queue head is admitted only when a batch row is free and every block it could
ever need (prompt + full budget, rounded up to whole blocks) is free; if it does not fit, it and
everything behind it wait. The requests admitted in one step form an admission group.
"""
from __future__ import annotations

from collections import deque

from traces.errors import InputError
from traces.workload import Request

from .block_pool import BlockPool


class Seq:
    """A request inside the engine: its blocks, progress and the times the records need."""

    __slots__ = ("req", "blocks_needed", "block_table", "kv_len", "generated", "admitted", "admit_step",
                 "group_id", "group_size", "first_token", "last_token", "finished", "token_times", "token_ids")

    def __init__(self, req: Request, blocks_needed: int):
        self.req = req
        self.blocks_needed = blocks_needed
        self.block_table: list[int] = []
        self.kv_len = 0  # tokens whose K/V are in the pool
        self.generated = 0
        self.admitted = self.first_token = self.last_token = self.finished = float("nan")
        self.admit_step = self.group_id = self.group_size = -1
        self.token_times: list[float] = []
        self.token_ids: list[int] = []

    @property
    def remaining(self) -> int:
        return self.req.budget - self.generated


class Scheduler:
    def __init__(self, max_batch: int, pool: BlockPool, max_tokens: int | None = None):
        if max_batch <= 0:
            raise ValueError(f"max batch must be positive, got {max_batch}")
        self.max_batch = max_batch
        self.pool = pool
        self.max_tokens = max_tokens  # prompt + budget the model can hold (its positions), None = unbounded
        self.queue: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.kv_tokens = 0  # K/V tokens held by running rows, kept incrementally for the simulator's speed
        self._seen: set[int] = set()
        self._groups = 0

    def check(self, req: Request) -> None:
        """Refuse a request the engine could never serve, naming why."""
        rid = req.request_id
        if req.prompt_tokens <= 0:
            raise InputError(f"request {rid}: empty prompt")
        if req.budget <= 0:
            raise InputError(f"request {rid}: token budget must be at least 1, got {req.budget}")
        if rid in self._seen:
            raise InputError(f"request {rid}: request id submitted twice")
        total = req.prompt_tokens + req.budget
        if self.max_tokens is not None and total > self.max_tokens:
            raise InputError(f"request {rid}: prompt {req.prompt_tokens} + budget {req.budget} = {total} tokens is beyond "
                             f"the model's {self.max_tokens} positions")
        need = self.pool.blocks_for(total)
        if need > self.pool.num_blocks:
            raise InputError(f"request {rid}: needs {need} blocks of {self.pool.block_size} tokens "
                             f"({total} tokens); the pool has {self.pool.num_blocks}")

    def submit(self, req: Request) -> Seq:
        self.check(req)
        self._seen.add(req.request_id)
        seq = Seq(req, self.pool.blocks_for(req.prompt_tokens + req.budget))
        self.queue.append(seq)
        return seq

    def can_admit(self) -> bool:
        return bool(self.queue) and len(self.running) < self.max_batch and self.queue[0].blocks_needed <= self.pool.free

    def admit(self, now: float, step: int) -> list[Seq]:
        """Admit from the queue head while a row and the head's full reservation are free."""
        group: list[Seq] = []
        while self.can_admit():
            seq = self.queue.popleft()
            seq.block_table = self.pool.allocate(seq.blocks_needed)
            seq.admitted, seq.admit_step = now, step
            group.append(seq)
            self.running.append(seq)  # at once, so can_admit counts the rows this group has taken
        if group:
            self._groups += 1
            for seq in group:
                seq.group_id, seq.group_size = self._groups - 1, len(group)
        return group

    def prefilled(self, group: list[Seq], t: float) -> None:
        """The group's prompts are in the pool and each has its first token (from the prefill)."""
        for seq in group:
            seq.kv_len = seq.req.prompt_tokens
            seq.generated = 1
            seq.first_token = seq.last_token = t
            self.kv_tokens += seq.kv_len

    def decode_rows(self) -> list[Seq]:
        return [s for s in self.running if s.generated < s.req.budget]

    def advance(self, rows: list[Seq], t: float, steps: int = 1) -> None:
        """`steps` decode steps for `rows` ended at `t`: each step wrote one token's K/V and generated one token."""
        for s in rows:
            s.kv_len += steps
            s.generated += steps
            s.last_token = t
        self.kv_tokens += steps * len(rows)

    def retire(self) -> list[Seq]:
        """Finish rows that generated their whole budget (at their last token) and free their blocks."""
        done = [s for s in self.running if s.generated >= s.req.budget]
        if done:
            self.running = [s for s in self.running if s.generated < s.req.budget]
            for s in done:
                s.finished = s.last_token
                self.kv_tokens -= s.kv_len
                self.pool.release(s.block_table)
        return done

    @property
    def submitted(self) -> int:
        """Requests accepted so far (every accepted id is distinct)."""
        return len(self._seen)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running
