"""The scheduler's policies, one small class each, behind one registry per kind; a name such as "chunked:512" is
parsed here and nowhere else.

Prefill policies decide what the prefill step of a pass computes, from the admitted sequences whose positions are
not yet all in the pool (oldest first). A sequence's positions to compute are its prompt's (after any cached
prefix), and after a preemption its prompt's and the tokens it had generated (a recompute):
- padded: the group admitted in this pass, every prompt padded to the group's widest (the write-up's engine);
- packed: the same group, each prompt at its true length;
- chunked:N: at most N prompt positions a step, oldest first (several short prompts can share a chunk; a long one
  spans several). A decode step for the rows that have their first token follows each chunk step, as it follows
  every prefill: the two stay separate steps, so a decode step is always the same graph-captured kernel sequence,
  and a chunk's cost is a prefill's.
- mixed:N: one fused step (vLLM V1, Sarathi-Serve): every decode row's next token, each a one-position sequence
  after its K/V in the pool, and as many prompt positions as fit in the rest of the N-token budget, oldest first.
  The step is one forward pass: the engine attends its decode rows with the decode kernel and its prompt positions
  with the prefill kernel, and the cost model prices it so (servecap/costs/model.py). Decode rows are never left out of a step
  (a running row that skipped steps would stall its stream), so N must hold every row: N >= max batch, as vLLM
  requires max_num_batched_tokens >= max_num_seqs. When the decode rows take all of N, the step carries no prompt
  positions and waiting prompts go on waiting until a row retires. With no prompt to compute, a pass is a stretch
  of ordinary decode steps.

Admission policies decide how many blocks a request must have free to be admitted:
- reserve: every block it could ever need (prompt + full budget), so an admitted request never waits for memory
  (and is never preempted).
- on-demand (vLLM's): the blocks of the positions it computes now and of its first decode token, plus a
  watermark of 1% of the pool left free (vLLM V0's default), so that admission does not at once force a
  preemption. A row's block table then grows a block at a time as it decodes. When a decode row's next token
  needs a block and none is free, the most recently admitted running request is preempted by recompute: its
  blocks are freed, it returns to the head of the queue (ahead of later arrivals, behind older preempted ones),
  and on readmission its prompt and the tokens it had generated are prefilled again. A pass that preempts
  admits no one (vLLM V0's rule), so a freed request is not readmitted into the memory it just gave up.

A per-step token cap (ServingConfig.max_num_batched_tokens, vLLM's name) bounds every prefill step: a padded or packed
admission group stops growing before its step would compute more positions than the cap (so a 32-row engine can
also serve 32k-token prompts, a few at a time), and a chunked or mixed step of N tokens must fit in it.

A new policy is one class registered in PREFILL or ADMISSION; the scheduler, the engine, the simulator, the CLIs
and the cost model's derivation check all take it from there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from servecap.traces.errors import InputError
from servecap.traces.workload import Request

from .block_pool import BlockPool
from .sequence import Seq

Selection = "tuple[list[Seq], list[int], list[int], list[int]]"  # seqs, prefix, new, computed


class PrefillPolicy:
    """What a pass's prefill step computes. Subclasses are frozen dataclasses named by `name`."""

    name: ClassVar[str]
    takes_size: ClassVar[bool] = False  # written name:N
    fuses: ClassVar[bool] = False  # its step also advances the decode rows (they lead its sequences)

    def select(self, prefilling: deque[Seq], decoding: list[Seq]) -> Selection:
        """The prefill step for the admitted sequences not yet whole in the pool (never empty), oldest first, with
        the rows that decode this pass (`decoding`; used by a fusing policy): the sequences it runs, the positions
        of each already in the pool, computed new, and computed in all (new plus padding)."""
        raise NotImplementedError

    def group_tokens(self, rows: int, widest: int, total: int) -> int:
        """The positions one prefill step computes for an admission group of `rows` prompts, `widest` positions in
        the widest and `total` in all: what the per-step token cap bounds at admission (0: the policy's own size
        bounds its steps, whatever the group)."""
        return 0

    def check(self, max_batch: int, max_step_tokens: int | None = None) -> None:
        """Refuse a batch (or a per-step token cap) this policy cannot serve (one line)."""

    @classmethod
    def sample(cls, chunk: int) -> "PrefillPolicy":
        """An instance for studies and calibration (a sized policy gets `chunk`)."""
        return cls(chunk) if cls.takes_size else cls()

    @staticmethod
    def parse(text: "str | PrefillPolicy") -> "PrefillPolicy":
        """'padded', 'packed' or 'chunked:N' (or a policy, returned as it is)."""
        if isinstance(text, PrefillPolicy):
            return text
        name, sep, n = str(text).strip().partition(":")
        cls = PREFILL.get(name)
        if cls is None:
            raise InputError(f"unknown prefill policy {name!r}; choose {policy_choices()}")
        if cls.takes_size:
            if not n.strip().isdigit():
                raise InputError(f"{text!r}: {name} prefill is written {name}:N, N a whole number of tokens >= 1")
            return cls(int(n))
        if sep:
            raise InputError(f"{text!r}: only {', '.join(k for k, c in PREFILL.items() if c.takes_size)} takes a "
                             f"size ({name} does not)")
        return cls()

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Padded(PrefillPolicy):
    name: ClassVar[str] = "padded"

    def select(self, prefilling, decoding):
        seqs = list(prefilling)  # the group admitted in this pass: nothing else is ever left half-prefilled
        prefix = [s.kv_len for s in seqs]
        new = [s.target - s.kv_len for s in seqs]
        return seqs, prefix, new, [max(new)] * len(seqs)

    def group_tokens(self, rows, widest, total):
        return rows * widest


@dataclass(frozen=True)
class Packed(PrefillPolicy):
    name: ClassVar[str] = "packed"

    def select(self, prefilling, decoding):
        seqs = list(prefilling)
        prefix = [s.kv_len for s in seqs]
        new = [s.target - s.kv_len for s in seqs]
        return seqs, prefix, new, new

    def group_tokens(self, rows, widest, total):
        return total


@dataclass(frozen=True)
class Chunked(PrefillPolicy):
    chunk: int  # prompt positions per chunk step
    name: ClassVar[str] = "chunked"
    takes_size: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise InputError(f"the chunk size must be a whole number of tokens >= 1, got {self.chunk!r}")

    def select(self, prefilling, decoding):
        return chunks(prefilling, self.chunk, [], [], [])

    def check(self, max_batch: int, max_step_tokens: int | None = None) -> None:
        if max_step_tokens is not None and self.chunk > max_step_tokens:
            raise InputError(f"{self}: its steps hold {self.chunk} tokens, more than the per-step cap "
                             f"(max_num_batched_tokens {max_step_tokens})")

    def __str__(self) -> str:
        return f"{self.name}:{self.chunk}"


def chunks(prefilling: deque[Seq], budget: int, seqs: list, prefix: list, new: list) -> Selection:
    """`seqs`, `prefix`, `new` continued with up to `budget` prompt positions, oldest prompt first."""
    for s in prefilling:
        if budget <= 0:
            break
        n = min(s.target - s.kv_len, budget)
        seqs.append(s)
        prefix.append(s.kv_len)
        new.append(n)
        budget -= n
    return seqs, prefix, new, list(new)


@dataclass(frozen=True)
class Mixed(Chunked):
    """Chunked prefill fused with every decode row in one step of at most `chunk` tokens."""

    name: ClassVar[str] = "mixed"
    fuses: ClassVar[bool] = True

    def select(self, prefilling, decoding):
        return chunks(prefilling, self.chunk - len(decoding), list(decoding), [s.kv_len for s in decoding],
                      [1] * len(decoding))

    def check(self, max_batch: int, max_step_tokens: int | None = None) -> None:
        super().check(max_batch, max_step_tokens)
        if self.chunk < max_batch:
            raise InputError(f"{self}: a fused step holds every decode row, so its token budget must be at least "
                             f"the max batch ({max_batch})")


PREFILL: dict[str, type[PrefillPolicy]] = {c.name: c for c in (Padded, Packed, Chunked, Mixed)}
PADDED = Padded()
STUDIED = ("padded", "packed", "chunked:512")  # the policies the predictions, the sag search and the notebooks compare


def policy_choices() -> str:
    return ", ".join(f"{k}:N" if c.takes_size else k for k, c in PREFILL.items())


def every_policy(chunk: int) -> tuple[PrefillPolicy, ...]:
    """One of each registered prefill policy (sized ones with `chunk`): the ones calibration measures. A fused
    policy's closed runs have decode rows in flight (servecap/calibrate/plan.py's fused_group)."""
    return tuple(c.sample(chunk) for c in PREFILL.values())


class AdmissionPolicy:
    """How many blocks the queue head must find free to be admitted (and are allocated to it then)."""

    name: ClassVar[str]
    grows: ClassVar[bool] = False  # block tables grow as rows decode (and rows may be preempted)

    def blocks_to_admit(self, req: Request, computed: int, pool: BlockPool) -> int:
        """Blocks allocated at admission to a request whose first `computed` positions are prefilled then (its
        prompt, or its prompt and generated tokens after a preemption)."""
        raise NotImplementedError

    def watermark(self, pool: BlockPool) -> int:
        """Blocks that must stay free beyond the admitted request's."""
        return 0

    @staticmethod
    def parse(text: "str | AdmissionPolicy") -> "AdmissionPolicy":
        if isinstance(text, AdmissionPolicy):
            return text
        cls = ADMISSION.get(str(text).strip())
        if cls is None:
            raise InputError(f"unknown admission policy {text!r}; choose {', '.join(ADMISSION)}")
        return cls()

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Reserve(AdmissionPolicy):
    """Reserve-on-admit: the prompt and the whole budget, rounded up to whole blocks."""

    name: ClassVar[str] = "reserve"

    def blocks_to_admit(self, req: Request, computed: int, pool: BlockPool) -> int:
        return pool.blocks_for(req.prompt_tokens + req.budget)


@dataclass(frozen=True)
class OnDemand(AdmissionPolicy):
    """Blocks as tokens are written, with preemption by recompute (module docstring)."""

    name: ClassVar[str] = "on-demand"
    grows: ClassVar[bool] = True
    WATERMARK: ClassVar[float] = 0.01

    def blocks_to_admit(self, req: Request, computed: int, pool: BlockPool) -> int:
        return pool.blocks_for(min(computed + 1, req.prompt_tokens + req.budget))

    def watermark(self, pool: BlockPool) -> int:
        return int(self.WATERMARK * pool.num_blocks)


ADMISSION: dict[str, type[AdmissionPolicy]] = {c.name: c for c in (Reserve, OnDemand)}
RESERVE = Reserve()
ON_DEMAND = OnDemand()
