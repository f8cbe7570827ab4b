"""The scheduler both clocks share: FIFO queue, batch rows, admission groups, retirement, and the shapes of the
steps it asks for; what to prefill and how much to reserve are its policies' (servecap/core/policies.py).

The engine drives it with real GPU steps and the simulator with modelled step costs; neither has scheduling
code of its own, so they cannot disagree about who is admitted when or what a step computes.

Admission: the queue head is admitted only when a batch row is free and the blocks its admission policy asks
for (reserve: prompt + full budget, in whole blocks; on-demand: what it computes now, plus a watermark) are free;
if it does not fit, it and everything behind it wait. The requests admitted in one step form an admission group;
with a per-step token cap (max_step_tokens, vLLM's max_num_batched_tokens) a padded or packed group also stops
before its prefill step would compute more positions than the cap, and the head not admitted for it comes in the
next pass (a request whose own prefill, or recompute after a preemption, would exceed it is refused).

A sequence gets its next token from the step that computes the last of its `target` positions: its prompt and
the tokens it has generated, less the last (whose K/V the next step writes). So a prompt's last chunk gives its
first token, a recompute after a preemption gives the token after those it had, and a decode row in a fused step
(a one-position sequence after its K/V in the pool) gives its next token: one rule for the three.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from servecap.costs.shapes import DecodeShape, PrefillShape
from servecap.traces.errors import InputError
from servecap.traces.workload import Request

from .block_pool import BlockPool
from .policies import PADDED, RESERVE, AdmissionPolicy, PrefillPolicy
from .prefix_cache import CachingBlockPool, block_keys
from .sequence import Seq

# The named tuples made every pass (a plan, a step's shape) are made from their fields in order, by tuple.__new__:
# a named tuple's own __new__ is a Python function that takes keywords.
_new = tuple.__new__


@dataclass
class PrefillWork:
    """One prefill step: for each sequence, `prefix` positions already in the pool, `new` positions computed now,
    and `computed` positions run (new plus padding, for padded). A fused step's first `decode` sequences are decode
    rows (one position each)."""

    seqs: list[Seq]
    prefix: list[int]
    new: list[int]
    computed: list[int]
    decode: int = 0
    # Made once, when the step is planned (not changed after): the timer, the runner and the recorder ask for them.
    shape: PrefillShape = field(init=False, repr=False, compare=False)
    done: list[bool] = field(init=False, repr=False, compare=False)
    # Positions a preemption lost, computed again: counted with each sequence's own as the scheduler plans the step
    # (Scheduler._prefilled), so that the count is made in one place.
    recomputed: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        # the scheduler's ints as they are
        self.shape = _new(PrefillShape, (tuple(self.computed), tuple(self.prefix), self.decode))
        self.done = [p + n == s.req.prompt_tokens + s.generated for s, p, n in zip(self.seqs, self.prefix, self.new)]

    @property
    def kind(self) -> str:
        """The step's kind as records name it (and as a serving-context correction keys the step after it)."""
        return "mixed" if self.decode else "prefill"

    @property
    def prompt_tokens(self) -> int:
        """Positions computed for prompts (and recomputes), not for decode rows."""
        return sum(self.new) - self.decode

    @property
    def padded_len(self) -> int:
        return max(self.computed)

    def completes(self, i: int) -> bool:
        """Whether sequence i has its target positions in the pool after this step (it then has its next token)."""
        return self.done[i]


def decode_shape(rows: list[Seq]) -> DecodeShape:
    """The decode step of `rows`: each row also reads the token it writes this step."""
    kv = [s.kv_len for s in rows]  # one list for both: the simulator asks for a shape on every pass
    return _new(DecodeShape, (len(rows), sum(kv) + len(rows), max(kv) + 1))


def steps_in_blocks(rows: list[Seq], block_size: int) -> int:
    """Decode steps the rows' block tables hold as they are: step j writes position kv_len + j - 1."""
    return min(len(s.block_table) * block_size - s.kv_len for s in rows)


class StepPlan(NamedTuple):
    """What one pass runs, decided at its start (Scheduler.schedule): admit a group, then at most one prefill step,
    then a stretch of 1 to max_steps decode steps of the same rows, cut after the first that ends at or after
    `stop` (when an admission could come). A named tuple: the simulator makes one every pass."""

    step: int  # the number of the pass's first step: its prefill step and its first decode step carry it
    group: list[Seq]  # the admission group (may be empty)
    prefill: PrefillWork | None
    first_tokens: list[Seq]  # the sequences the prefill step completes: their next token comes from it
    rows: list[Seq]  # the decode rows once the prefill step is done (first token, budget left); may be empty
    shape: DecodeShape | None  # the first decode step's shape
    max_steps: int
    stop: float
    preempted: list[Seq]  # requests preempted at the pass's start (back at the head of the queue)


class Lookahead(Protocol):
    """What the scheduler asks of the arrivals to bound a decode stretch (the step loop's Arrivals are one; the
    protocol is the scheduler's so that it need not import the loop that drives it). Invariant: next_candidate never
    says later than the first moment a request the scheduler would accept can arrive (it bounds fast-forward: a
    bound too early costs a pass, one too late would change the run)."""

    def next_candidate(self, sched: Scheduler) -> tuple[float, Request | None]:
        """When the next request the scheduler could admit may arrive, and that request where it is known (the
        scheduler then checks it fits: Scheduler.next_admission holds the admission rule)."""


_NONE: list = []  # an empty list no one appends to (no one admitted or preempted, no first tokens): made once


class Scheduler:
    def __init__(self, max_batch: int, pool: BlockPool, max_tokens: int | None = None, policy: PrefillPolicy = PADDED,
                 admission: AdmissionPolicy = RESERVE, max_step_tokens: int | None = None):
        if max_batch <= 0:
            raise ValueError(f"max batch must be positive, got {max_batch}")
        self.max_batch = max_batch
        self.pool = pool
        self.max_tokens = max_tokens  # prompt + budget the model can hold (its positions), None = unbounded
        self.policy = policy
        self.admission = admission
        self.max_step_tokens = max_step_tokens  # positions a prefill step may compute (None: unbounded)
        # whether admission groups are cut by the cap: the policy's steps grow with the group
        self._capped = max_step_tokens is not None and policy.group_tokens(1, 1, 1) > 0
        self.queue: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.prefilling: deque[Seq] = deque()  # admitted, prompt not yet whole in the pool, in admission order
        self._seen: set[int] = set()
        self._groups = 0
        self._watermark = admission.watermark(pool)
        self._grows, self._fuses = admission.grows, policy.fuses  # asked every pass
        # Whether every running row past its prompt has tokens left (none waits to retire): then the decode rows are
        # the running rows, found without looking at each, and retire() has nothing to do. A row finishes only in a
        # prefill step that gives its last token, or in a decode stretch that ran to its bound (at most every
        # running row's remaining tokens: one cut short by an arrival finished none).
        self._settled = True
        self._bound = 1  # the last plan's bound on its decode stretch
        self.caching = isinstance(pool, CachingBlockPool)
        # The arrivals' next candidate and the blocks it takes without caching (its request's alone): asked every
        # pass until it comes.
        self._candidate: tuple[Request | None, int] = (None, 0)
        self.preemptions = 0
        policy.check(max_batch, max_step_tokens)

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
        if self._capped:
            # a preempted request recomputes its prompt and what it had generated, in one step of its own
            n = req.prompt_tokens + (req.budget - 1 if self._grows else 0)
            if self.policy.group_tokens(1, n, n) > self.max_step_tokens:
                raise InputError(f"request {rid}: its prefill of {n} positions is beyond the per-step cap "
                                 f"(max_num_batched_tokens {self.max_step_tokens}); chunked:N or mixed:N prefill "
                                 f"splits it")
        # The most blocks a request ever needs free at once, under any admission policy: its whole prompt and
        # budget (reserved at admission, or readmitted to recompute after a preemption) beside the watermark.
        need = self.pool.blocks_for(total) + self._watermark
        if need > self.pool.num_blocks:
            raise InputError(f"request {rid}: needs {need} blocks of {self.pool.block_size} tokens "
                             f"({total} tokens); the pool has {self.pool.num_blocks}")

    def _seq(self, req: Request) -> Seq:
        seq = Seq(req, self.admission.blocks_to_admit(req, req.prompt_tokens, self.pool))
        if self.caching:
            seq.keys = block_keys(req, self.pool.block_size)
        return seq

    def submit(self, req: Request) -> Seq:
        self.check(req)
        self._seen.add(req.request_id)
        seq = self._seq(req)
        self.queue.append(seq)
        return seq

    def schedule(self, now: float, step: int, lookahead: Lookahead | None = None) -> StepPlan:
        """Plan the pass that starts at `now` as step `step`: admit, choose the prefill step and the decode rows.
        The prefill step's bookkeeping (positions in the pool, first tokens generated) is done here; its time, and
        every decode step's, are set once they have run (the loop's, advance). With `lookahead` (a timer that
        can price a stretch of decode steps), the stretch is bounded by the next point where this scheduler has
        something to decide: a row finishing, a chunk step due, or an arrival it could admit."""
        preempted = self._grow() if self._grows else _NONE
        group = self.admit(now, step) if self.queue and not preempted else _NONE
        work, first = None, _NONE
        if self.prefilling:
            if self._fuses:
                decoding = self.decode_rows()
                work = PrefillWork(*self.policy.select(self.prefilling, decoding), len(decoding))
            else:
                work = PrefillWork(*self.policy.select(self.prefilling, _NONE))
            first = self._prefilled(work)
        rows = [] if self._fuses and work is not None else self.decode_rows()
        if not rows:
            return _new(StepPlan, (step, group, work, first, rows, None, 0, math.inf, preempted))
        limit = self._bound = self.max_decode_steps(rows) if lookahead is not None else 1
        stop = self.next_admission(lookahead) if limit > 1 else math.inf
        return _new(StepPlan, (step, group, work, first, rows, decode_shape(rows), limit, stop, preempted))

    def _grow(self) -> list[Seq]:
        """On-demand: give every decode row the block its next token's K/V goes to, preempting the most recently
        admitted running request (the row itself, when it is the most recent) while none is free. Returns the
        preempted, in the order preempted."""
        pool, bs, running = self.pool, self.pool.block_size, self.running
        preempted: list[Seq] = []
        i = 0
        while i < len(running):
            s = running[i]
            if s.prefilling or s.generated >= s.budget or s.kv_len < len(s.block_table) * bs:
                i += 1  # its next write has its block (a prefilling row holds its prompt's blocks)
                continue
            while not pool.free and running[-1] is not s:
                preempted.append(self._preempt(running[-1]))
            if pool.free:
                s.block_table += pool.allocate(1)
                i += 1
            else:  # the row is the most recent itself: it gives up its own blocks
                preempted.append(self._preempt(s))
        return preempted

    def _preempt(self, s: Seq) -> Seq:
        """Free a running request's blocks and put it back at the head of the queue, to be recomputed."""
        self.running.remove(s)
        if s.prefilling:
            self.prefilling.remove(s)
            s.prefilling = False
        self.pool.release(s.block_table)
        s.block_table = []
        s.peak = max(s.peak, s.kv_len)
        s.kv_len = 0
        s.preemptions += 1
        self.preemptions += 1
        s.blocks_needed = self.admission.blocks_to_admit(s.req, s.target, self.pool)
        self.queue.appendleft(s)
        return s

    def next_admission(self, arrivals: Lookahead) -> float:
        """The earliest time an admission can happen before the running rows change: never while the queue head
        waits for blocks or no row is free; else when the arrivals' next candidate comes, unless it is a known
        request that does not fit in the free blocks (it would block everything behind it). With prefix caching a
        waiting head can fit once this pass's prefill has cached the prefix it shares: then at once."""
        if self.queue:  # it waits for blocks or a row, unless the cache or the step cap is what held it back
            return -math.inf if (self.caching or self._capped) and self.can_admit() else math.inf
        if len(self.running) >= self.max_batch:
            return math.inf
        when, req = arrivals.next_candidate(self)
        if req is not None:
            if self.caching:
                need = self._need(self._seq(req))[0]
            else:
                known, need = self._candidate
                if known is not req:
                    need = self.admission.blocks_to_admit(req, req.prompt_tokens, self.pool)
                    self._candidate = (req, need)
            if need + self._watermark > self.pool.free:
                return math.inf
        return when

    def can_admit(self, free: int | None = None) -> bool:
        """Whether the queue head is admitted now (with `free` blocks free: the pool's, unless given)."""
        if not self.queue or len(self.running) >= self.max_batch:
            return False
        head = self.queue[0]
        need = self._need(head)[0] if head.keys else head.blocks_needed  # most passes: no cache, no call
        return need + self._watermark <= (self.pool.free if free is None else free)

    def _need(self, seq: Seq) -> tuple[int, list[int]]:
        """The free blocks the sequence takes at admission, and the cached blocks it shares (prefix caching): its
        admission policy's blocks less the shared ones, plus those of them no one holds now (they count as free).
        At least one position is left to compute, for the logits of its next token."""
        if not seq.keys:
            return seq.blocks_needed, []
        pool = self.pool
        hits = pool.match(seq.keys, (seq.target - 1) // pool.block_size)
        return seq.blocks_needed - len(hits) + pool.taken_from_free(hits), hits

    def admit(self, now: float, step: int) -> list[Seq]:
        """Admit from the queue head while a row and the blocks its admission policy asks for are free."""
        group: list[Seq] = []
        pool = self.pool
        widest = total = 0  # the group's prefill positions, for the step cap
        while self.can_admit():
            seq = self.queue[0]
            hits = self._need(seq)[1] if seq.keys else []
            if self._capped:
                new = seq.target - len(hits) * pool.block_size
                widest, total = max(widest, new), total + new
                if group and self.policy.group_tokens(len(group) + 1, widest, total) > self.max_step_tokens:
                    break
            self.queue.popleft()
            if seq.keys:
                pool.take(hits, min(len(seq.keys), (seq.target - 1) // pool.block_size))
                seq.kv_len = len(hits) * pool.block_size
                seq.cached += seq.kv_len
            seq.block_table = hits + pool.allocate(seq.blocks_needed - len(hits))
            if seq.preemptions == 0:  # a readmission keeps its first admission's time
                seq.admitted, seq.admit_step = now, step
            seq.prefilling = True
            group.append(seq)
            self.running.append(seq)  # at once, so can_admit counts the rows this group has taken
        if group:
            self._groups += 1
            for seq in group:
                seq.group_id, seq.group_size = self._groups - 1, len(group)
            self.prefilling.extend(group)
        return group

    def _prefilled(self, work: PrefillWork) -> list[Seq]:
        """The step's positions are in the pool; the sequences it completes have their next token. Returns those."""
        done = []
        for s, n, d in zip(work.seqs, work.new, work.done):
            if s.keys:
                self._cache_full_blocks(s, s.kv_len, s.kv_len + n)
            if s.peak:
                again = max(0, min(s.kv_len + n, s.peak) - s.kv_len)
                s.recomputed += again
                work.recomputed += again
            s.kv_len += n
            if d:
                s.generated += 1
                done.append(s)
                if s.generated >= s.budget:
                    self._settled = False
        for s in done[work.decode:]:  # prompts complete in admission order, so the finished ones lead the deque
            self.prefilling.popleft().prefilling = False
        return done

    def _cache_full_blocks(self, s: Seq, start: int, end: int) -> None:
        """Positions start..end of the sequence are now in the pool: address the prompt blocks they complete."""
        bs = self.pool.block_size
        for j in range(start // bs, min(end // bs, len(s.keys))):
            self.pool.cache(s.block_table[j], s.keys[j])

    def decode_rows(self) -> list[Seq]:
        """Rows with their first token and budget left: the ones a decode step advances."""
        if self._settled and not self.prefilling:  # most passes: every running row
            return list(self.running)
        return [s for s in self.running if not s.prefilling and s.generated < s.budget]

    def stretch_goes_on(self) -> bool:
        """Whether the pass schedule() would plan now, with nothing retired since the last, only decodes the rows
        that are running, as the last pass did: no prompt left to compute, no one to admit, no one to preempt for a
        block. Where it does not, the engine's decode stretch ended with the last pass (whose end the step loop
        charges: StepTimer.stretch_ended). Answers as schedule() decides, without changing anything."""
        if self.prefilling:
            return False
        free = self.pool.free
        if self._grows:  # _grow gives each row that needs one a block first, preempting only when none is free
            bs = self.pool.block_size
            free -= sum(1 for s in self.running if s.generated < s.budget and s.kv_len >= len(s.block_table) * bs)
            if free < 0:
                return False
        return not self.can_admit(free)

    def max_decode_steps(self, rows: list[Seq]) -> int:
        """Decode steps that can run back to back before the scheduler has anything to decide: until the first
        running row finishes, one while prompts still wait for chunk steps, and (on-demand) while the free blocks
        hold what the rows grow into (at least 1)."""
        if self.prefilling:
            return 1
        k = max(1, min([s.budget - s.generated for s in self.running]))  # each row's remaining, inlined
        if self._grows and k > 1:
            k = self._steps_in_free_blocks(rows, k)
        return k

    def _steps_in_free_blocks(self, rows: list[Seq], k: int) -> int:
        """The most decode steps, up to k, whose new blocks the free ones hold (the first step's are allocated):
        step j writes position kv_len + j - 1, so after j steps a row holds blocks_for(kv_len + j)."""
        bs, free = self.pool.block_size, self.pool.free
        have = [(s.kv_len, len(s.block_table) * bs) for s in rows]

        def need(j: int) -> int:
            return sum([-(-(n + j - cap) // bs) for n, cap in have if n + j > cap])

        lo, hi = 1, k
        while lo < hi:  # need() grows with j: the largest j with need(j) <= free
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance(self, rows: list[Seq], t: float, steps: int = 1) -> None:
        """`steps` decode steps for `rows` ended at `t`: each step wrote one token's K/V and generated one token.
        On-demand, a stretch's later steps take their blocks here (Scheduler.max_decode_steps left room)."""
        for s in rows:
            s.kv_len += steps
            s.generated += steps
            s.last_token = t
        if steps >= self._bound:  # the row with the fewest tokens left may have had its last
            self._settled = False
        if self._grows and steps > 1:
            pool, bs = self.pool, self.pool.block_size
            for s in rows:
                more = -(-s.kv_len // bs) - len(s.block_table)
                if more > 0:
                    s.block_table += pool.allocate(more)

    def retire(self) -> list[Seq]:
        """Finish rows that generated their whole budget (at their last token) and free their blocks."""
        if self._settled:
            return _NONE
        done = [s for s in self.running if s.generated >= s.budget]
        for s in done:  # a pass retires a row or two: each taken out where it is, the batch not copied
            self.running.remove(s)
            s.finished = s.last_token
            self.pool.release(s.block_table)
        self._settled = True
        return done

    @property
    def submitted(self) -> int:
        """Requests accepted so far (every accepted id is distinct)."""
        return len(self._seen)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running
