"""The scheduler both clocks share: FIFO queue, batch rows, admission groups, retirement, and the shapes of the
steps it asks for; what to prefill and how much to reserve are its policies' (core/policies.py).

The engine drives it with real GPU steps and the simulator with modelled step costs; neither has scheduling
code of its own, so they cannot disagree about who is admitted when or what a step computes.

Admission: the queue head is admitted only when a batch row is free and the blocks its admission policy asks
for (reserve: prompt + full budget, in whole blocks) are free; if it does not fit, it and everything behind it
wait. The requests admitted in one step form an admission group. A prompt whose last positions are computed in
a step gets its first token from that step.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from costs.shapes import DecodeShape, PrefillShape
from traces.errors import InputError
from traces.workload import Request

from .block_pool import BlockPool
from .policies import PADDED, RESERVE, AdmissionPolicy, PrefillPolicy

if TYPE_CHECKING:
    from .step_loop import Arrivals

class Seq:
    """A request inside the engine: its blocks, progress and the times the records need."""

    __slots__ = ("req", "budget", "blocks_needed", "block_table", "kv_len", "generated", "admitted", "admit_step",
                 "group_id", "group_size", "first_token", "last_token", "finished", "token_times", "token_ids")

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

    @property
    def remaining(self) -> int:
        return self.budget - self.generated


@dataclass
class PrefillWork:
    """One prefill step: for each sequence, `prefix` prompt positions already in the pool, `new` prompt positions
    computed now, and `computed` positions run (new plus padding, for padded)."""

    seqs: list[Seq]
    prefix: list[int]
    new: list[int]
    computed: list[int]
    # Made once from computed and prefix (not changed after): the timer and the recorder both ask for it.
    shape: PrefillShape = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.shape = PrefillShape(tuple(self.computed), tuple(self.prefix))  # the scheduler's ints: no conversion

    @property
    def prompt_tokens(self) -> int:
        return sum(self.new)

    @property
    def padded_len(self) -> int:
        return max(self.computed)

    def completes(self, i: int) -> bool:
        """Whether sequence i's prompt is whole in the pool after this step (it then has its first token)."""
        return self.prefix[i] + self.new[i] == self.seqs[i].req.prompt_tokens


def decode_shape(rows: list[Seq]) -> DecodeShape:
    """The decode step of `rows`: each row also reads the token it writes this step."""
    kv = [s.kv_len for s in rows]  # one list for both: the simulator asks for a shape on every pass
    return DecodeShape(len(rows), sum(kv) + len(rows), max(kv) + 1)


class StepPlan(NamedTuple):
    """What one pass runs, decided at its start (Scheduler.schedule): admit a group, then at most one prefill step,
    then a stretch of 1 to max_steps decode steps of the same rows, cut after the first that ends at or after
    `stop` (when an admission could come). A named tuple: the simulator makes one every pass."""

    step: int  # the number of the pass's first step: its prefill step and its first decode step carry it
    group: list[Seq]  # the admission group (may be empty)
    prefill: PrefillWork | None
    first_tokens: list[Seq]  # the prompts the prefill step completes: their first token comes from it
    rows: list[Seq]  # the decode rows once the prefill step is done (first token, budget left); may be empty
    shape: DecodeShape | None  # the first decode step's shape
    max_steps: int
    stop: float


_plan = tuple.__new__  # StepPlan's fields as one tuple, without the named tuple's keyword-taking __new__


class Scheduler:
    def __init__(self, max_batch: int, pool: BlockPool, max_tokens: int | None = None, policy: PrefillPolicy = PADDED,
                 admission: AdmissionPolicy = RESERVE):
        if max_batch <= 0:
            raise ValueError(f"max batch must be positive, got {max_batch}")
        self.max_batch = max_batch
        self.pool = pool
        self.max_tokens = max_tokens  # prompt + budget the model can hold (its positions), None = unbounded
        self.policy = policy
        self.admission = admission
        self.queue: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.prefilling: deque[Seq] = deque()  # admitted, prompt not yet whole in the pool, in admission order
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
        need = self.admission.blocks_to_admit(req, self.pool)
        if need > self.pool.num_blocks:
            raise InputError(f"request {rid}: needs {need} blocks of {self.pool.block_size} tokens "
                             f"({total} tokens); the pool has {self.pool.num_blocks}")

    def submit(self, req: Request) -> Seq:
        self.check(req)
        self._seen.add(req.request_id)
        seq = Seq(req, self.admission.blocks_to_admit(req, self.pool))
        self.queue.append(seq)
        return seq

    def schedule(self, now: float, step: int, lookahead: Arrivals | None = None) -> StepPlan:
        """Plan the pass that starts at `now` as step `step`: admit, choose the prefill step and the decode rows.
        The prefill step's bookkeeping (positions in the pool, first tokens generated) is done here; its time, and
        every decode step's, are set once they have run (the loop's, advance). With `lookahead` (a timer that
        can price a stretch of decode steps), the stretch is bounded by the next point where this scheduler has
        something to decide: a row finishing, a chunk step due, or an arrival it could admit."""
        group = self.admit(now, step)
        work, first = None, []
        if self.prefilling:
            work = PrefillWork(*self.policy.select(self.prefilling))
            first = self._prefilled(work)
        rows = self.decode_rows()
        if not rows:
            return _plan(StepPlan, (step, group, work, first, rows, None, 0, math.inf))
        limit = self.max_decode_steps() if lookahead is not None else 1
        stop = self.next_admission(lookahead) if limit > 1 else math.inf
        return _plan(StepPlan, (step, group, work, first, rows, decode_shape(rows), limit, stop))

    def next_admission(self, arrivals: Arrivals) -> float:
        """The earliest time an admission can happen before the running rows change: never while the queue head
        waits for blocks or no row is free; else when the arrivals' next candidate comes, unless it is a known
        request that does not fit in the free blocks (it would block everything behind it)."""
        if self.queue or len(self.running) >= self.max_batch:
            return math.inf
        when, req = arrivals.next_candidate(self)
        if req is not None and self.admission.blocks_to_admit(req, self.pool) > self.pool.free:
            return math.inf
        return when

    def can_admit(self) -> bool:
        return bool(self.queue) and len(self.running) < self.max_batch and self.queue[0].blocks_needed <= self.pool.free

    def admit(self, now: float, step: int) -> list[Seq]:
        """Admit from the queue head while a row and the head's full reservation are free."""
        if not self.can_admit():  # most passes admit no one
            return []
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
            self.prefilling.extend(group)
        return group

    def _prefilled(self, work: PrefillWork) -> list[Seq]:
        """The step's positions are in the pool; prompts it completes have their first token. Returns those."""
        done = []
        for i, s in enumerate(work.seqs):
            s.kv_len += work.new[i]
            if work.completes(i):
                s.generated = 1
                done.append(s)
        for _ in done:  # prompts complete in admission order, so the finished ones lead the deque
            self.prefilling.popleft()
        return done



    def decode_rows(self) -> list[Seq]:
        """Rows with their first token and budget left: the ones a decode step advances."""
        return [s for s in self.running if 0 < s.generated < s.budget]

    def max_decode_steps(self) -> int:
        """Decode steps that can run back to back before the scheduler has anything to decide: until the first
        running row finishes, and one while prompts still wait for chunk steps (at least 1)."""
        if self.prefilling:
            return 1
        return max(1, min([s.budget - s.generated for s in self.running]))  # each row's remaining, inlined

    def advance(self, rows: list[Seq], t: float, steps: int = 1) -> None:
        """`steps` decode steps for `rows` ended at `t`: each step wrote one token's K/V and generated one token."""
        for s in rows:
            s.kv_len += steps
            s.generated += steps
            s.last_token = t

    def retire(self) -> list[Seq]:
        """Finish rows that generated their whole budget (at their last token) and free their blocks."""
        done = [s for s in self.running if s.generated >= s.budget]
        if done:
            self.running = [s for s in self.running if s.generated < s.budget]
            for s in done:
                s.finished = s.last_token
                self.pool.release(s.block_table)
        return done

    @property
    def submitted(self) -> int:
        """Requests accepted so far (every accepted id is distinct)."""
        return len(self._seen)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running
