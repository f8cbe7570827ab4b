"""Step shapes: the few numbers that set what one engine step costs, computed in one place.

A decode step is priced by its rows, the K/V tokens they hold and the longest row; a prefill step by its
rows, the token positions it computes and the causal attention work among them. The scheduler builds these
shapes, the engine records them, the cost model prices them and calibration measures them.
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Sequence

BACKENDS = ("paged", "dense")  # decode backends: paged attention at true lengths; every row read at the widest
RENAMED_BACKENDS = {"padded": "dense"}  # old name: current name (old commands, records and tables still work)


def backend_named(name: str) -> str:
    """The current name of a decode backend given by its current or its old name."""
    return RENAMED_BACKENDS.get(name, name)


def backend_from_user(name: str, prog: str) -> str:
    """A backend named on a command line: its current name, with a warning on stderr for an old one."""
    new = backend_named(name)
    if new != name:
        print(f"{prog}: warning: the decode backend {name!r} is now called {new!r}; {name!r} still works for now",
              file=sys.stderr)
    return new


def kv_read(backend: str, rows: int, kv_tokens, kv_max):
    """K/V tokens a decode step's attention reads: true lengths (paged) or every row at the widest (dense).

    Numbers or numpy arrays (a stretch of steps)."""
    return kv_tokens if backend == "paged" else rows * kv_max


class DecodeShape(NamedTuple):
    """One decode step: `rows` rows holding `kv_tokens` K/V tokens in all and `kv_max` in the longest, each
    counting the token the row writes in this step (it attends to itself). A named tuple, not a frozen dataclass:
    the step loop makes one every pass, and a frozen dataclass takes several times as long to make."""

    rows: int
    kv_tokens: int
    kv_max: int

    def after(self, steps: int) -> "DecodeShape":
        """The shape `steps` steps later: every row has written one more token a step."""
        return DecodeShape(self.rows, self.kv_tokens + self.rows * steps, self.kv_max + steps)


class PrefillShape(NamedTuple):
    """One prefill step: sequence i computes `computed[i]` positions after `prefix[i]` already in the pool (a
    padded group's rows compute the whole padded length; a chunk follows the prompt's earlier chunks). A named
    tuple, as DecodeShape: the simulator makes one and hashes it (the cost model's cache) for most requests.

    rows, tokens and attn are what the records keep: attn is the causal attention work, the sum over sequences of
    n * (n + 2p) (each position attends to the prefix and to itself and the positions before it, about n^2 / 2
    pairs, counted twice so that a whole prompt's work is the square of its length).

    A fused step's first `decode` sequences are its decode rows (one position each, after their K/V): an engine
    that attends them with its decode kernel runs only the rest through the prefill kernel."""

    computed: tuple[int, ...]
    prefix: tuple[int, ...]
    decode: int = 0

    @property
    def rows(self) -> int:
        return len(self.computed)

    @property
    def tokens(self) -> int:
        return sum(self.computed)

    @property
    def attn(self) -> int:
        return sum([n * (n + 2 * p) for n, p in zip(self.computed, self.prefix)])

    @property
    def span(self) -> float:
        """Attention work per computed position: a whole prompt's own length; a padded group's padded length."""
        return self.attn / self.tokens

    @property
    def decode_kv(self) -> int:
        """K/V tokens a fused step's decode rows read: each row's prefix and the token it writes now."""
        return sum(self.prefix[:self.decode]) + self.decode

    @property
    def prompts(self) -> "PrefillShape":
        """The step without its decode rows: the sequences a fused step's prefill kernel runs."""
        return PrefillShape(self.computed[self.decode:], self.prefix[self.decode:])

    @classmethod
    def of(cls, computed: Sequence[int], prefix: Sequence[int] | None = None, decode: int = 0) -> "PrefillShape":
        return cls(tuple(map(int, computed)), tuple(map(int, prefix)) if prefix else (0,) * len(computed), int(decode))

    @classmethod
    def padded(cls, width: int, padded_len: int) -> "PrefillShape":
        """`width` prompts padded to `padded_len`: every row computes the whole padded length."""
        return cls((padded_len,) * width, (0,) * width)
