"""The scheduler's policies, one small class each, behind one registry per kind; a name such as "chunked:512" is
parsed here and nowhere else.

Prefill policies decide what the prefill step of a pass computes, from the admitted prompts not yet whole in the
pool (oldest first):
- padded: the group admitted in this pass, every prompt padded to the group's widest (the write-up's engine);
- packed: the same group, each prompt at its true length;
- chunked:N: at most N prompt positions a step, oldest first (several short prompts can share a chunk; a long one
  spans several). A decode step for the rows that have their first token follows each chunk step, as it follows
  every prefill: the two stay separate steps, so a decode step is always the same graph-captured kernel sequence,
  and a chunk's cost is a prefill's.

Admission policies decide how many blocks a request must have free to be admitted:
- reserve: every block it could ever need (prompt + full budget), so an admitted request never waits for memory
  (and is never preempted).

A new policy is one class registered in PREFILL or ADMISSION; the scheduler, the engine, the simulator, the CLIs
and the cost model's derivation check all take it from there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from traces.errors import InputError

if TYPE_CHECKING:  # the scheduler imports this module
    from traces.workload import Request

    from .block_pool import BlockPool
    from .scheduler import Seq

Selection = "tuple[list[Seq], list[int], list[int], list[int]]"  # seqs, prefix, new, computed


class PrefillPolicy:
    """What a pass's prefill step computes. Subclasses are frozen dataclasses named by `name`."""

    name: ClassVar[str]
    takes_size: ClassVar[bool] = False  # written name:N

    def select(self, prefilling: deque[Seq]) -> Selection:
        """The prefill step for the admitted prompts not yet whole in the pool (never empty), oldest first: the
        sequences it runs, the positions of each already in the pool, computed new, and computed in all (new
        plus padding)."""
        raise NotImplementedError

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

    def select(self, prefilling):
        seqs = list(prefilling)  # the group admitted in this pass: nothing else is ever left half-prefilled
        new = [s.req.prompt_tokens for s in seqs]
        return seqs, [0] * len(seqs), new, [max(new)] * len(seqs)


@dataclass(frozen=True)
class Packed(PrefillPolicy):
    name: ClassVar[str] = "packed"

    def select(self, prefilling):
        seqs = list(prefilling)
        new = [s.req.prompt_tokens for s in seqs]
        return seqs, [0] * len(seqs), new, new


@dataclass(frozen=True)
class Chunked(PrefillPolicy):
    chunk: int  # prompt positions per chunk step
    name: ClassVar[str] = "chunked"
    takes_size: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise InputError(f"the chunk size must be a whole number of tokens >= 1, got {self.chunk!r}")

    def select(self, prefilling):
        seqs, prefix, new, budget = [], [], [], self.chunk
        for s in prefilling:
            if not budget:
                break
            n = min(s.req.prompt_tokens - s.kv_len, budget)
            seqs.append(s)
            prefix.append(s.kv_len)
            new.append(n)
            budget -= n
        return seqs, prefix, new, list(new)

    def __str__(self) -> str:
        return f"{self.name}:{self.chunk}"


PREFILL: dict[str, type[PrefillPolicy]] = {c.name: c for c in (Padded, Packed, Chunked)}
PADDED = Padded()
STUDIED = ("padded", "packed", "chunked:512")  # the policies the predictions, the sag search and the notebooks compare


def policy_choices() -> str:
    return ", ".join(f"{k}:N" if c.takes_size else k for k, c in PREFILL.items())


def every_policy(chunk: int) -> tuple[PrefillPolicy, ...]:
    """One of each registered prefill policy (sized ones with `chunk`): what calibration measures."""
    return tuple(c.sample(chunk) for c in PREFILL.values())


class AdmissionPolicy:
    """How many blocks the queue head must find free to be admitted (and are allocated to it then)."""

    name: ClassVar[str]

    def blocks_to_admit(self, req: Request, pool: BlockPool) -> int:
        raise NotImplementedError

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

    def blocks_to_admit(self, req: Request, pool: BlockPool) -> int:
        return pool.blocks_for(req.prompt_tokens + req.budget)


ADMISSION: dict[str, type[AdmissionPolicy]] = {c.name: c for c in (Reserve,)}
RESERVE = Reserve()
