"""The parity gate: the paged engine against HF transformers' greedy `generate`, token for token.

Scenarios follow the write-up's gate: single requests, a uniform batch, a mixed batch, 8 requests queued
through 4 rows; the `paged` backend against the `padded` one; and packed and chunked prefill (prompts cut into
chunks of an eighth of the longest prompt) against padded prefill. On the CPU in float32 the tokens must
match exactly. In fp16 on a GPU two correct implementations can differ where the reference's top two
logits nearly tie, so a mismatch is reported with the reference's top-2 margin at that step, and a
near-tie flip is counted apart from a real mismatch, never hidden.

What counts as a near tie depends on the reference alone: its top-2 margin at the token, against a bound on how
far rounding can move that margin at the reference's logit scale (near_tie_bound). The engine's own logit
difference is reported beside it but excuses nothing: an engine that computes further off must not be
forgiven more.

The bound. Tensor-core products and the Triton kernels accumulate in fp32, so a length-n sum adds about
n * 2^-24, far below one fp16 rounding; the error that reaches the logits comes from the activations stored in the
model's dtype, each rounded once with relative error at most u (fp16: u = 2^-11). On the way to the logits a
decoder layer stores about R = 8 tensors on the residual path (input norm, QKV, attention output, its projection
added to the residual, post-attention norm, gate/up, SiLU * up, down added to the residual); with L layers plus the
final norm and the LM head's output that is m = R * L + 2 roundings (Qwen2.5-1.5B: 226). Independent roundings
add like a random walk (the probabilistic error analysis of Higham and Mary, SIAM J. Sci. Comput. 2019: sqrt(m) u
rather than the worst case m u), and a logit z_j = w_j . h moves by w_j . dh, which for a hidden-state error of
relative size sqrt(m) u is sqrt(m) u times the logits' typical size s (their RMS over the vocabulary). The margin
is the difference of two logits, each computed by two implementations with independent errors: sd of its error
2 sqrt(m) u s. The bound is three of those: 6 sqrt(m) u s, about 0.044 s in fp16 at 28 layers. A margin above it
is a real mismatch whatever the engine's logit difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from servecap.core.policies import PrefillPolicy
from servecap.traces.prompts import QWEN_TEXT_VOCAB, prompt_tokens
from servecap.traces.workload import Trace, length_trace

from .engine import Engine

ROUNDINGS_PER_LAYER = 8  # activations stored in the model's dtype on a decoder layer's residual path (docstring)
NEAR_TIE_SIGMAS = 3.0


def near_tie_bound(logit_scale: float, layers: int, unit_roundoff: float = 2.0 ** -11) -> float:
    """How far rounding can move a top-2 margin of logits whose RMS is `logit_scale`: NEAR_TIE_SIGMAS standard
    deviations of the margin's error, 2 sqrt(m) u s with m = ROUNDINGS_PER_LAYER * layers + 2 (module docstring)."""
    m = ROUNDINGS_PER_LAYER * layers + 2
    return NEAR_TIE_SIGMAS * 2 * math.sqrt(m) * unit_roundoff * logit_scale


@dataclass
class Mismatch:
    scenario: str
    backend: str
    request_id: int
    index: int  # first token that differs; everything after it follows a different context
    got: int
    want: int
    margin: float  # the reference's top-1 minus top-2 logit at that token
    logit_diff: float  # max |engine - reference| over the vocabulary of the prompt's first-token logits (reported)
    bound: float  # near_tie_bound at the reference's logit scale at that token

    @property
    def near_tie(self) -> bool:
        """The top two can swap by rounding alone: the reference's margin within the rounding bound."""
        return self.margin <= self.bound


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # each step's top-1 minus top-2 logit
    scales: list[float]  # each step's logit RMS over the vocabulary
    diff: float  # max |engine - HF| of the first-token logits: how far apart the two compute


def reference(engine: Engine, prompt_len: int, budget: int) -> Reference:
    """HF greedy decode of the prompt of `prompt_len` tokens: the tokens, each step's top-2 logit margin and logit
    scale, and the largest difference between the engine's and HF's first-token logits."""
    hf, vocab = engine.loaded.hf, engine.loaded.spec["vocab_size"]
    ids = torch.tensor([prompt_tokens(prompt_len, min(vocab, QWEN_TEXT_VOCAB))], device=hf.device)
    hf.generation_config.eos_token_id = None  # every request generates exactly its budget
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, min_new_tokens=budget,
                      do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logits = [lg[0].float() for lg in out.logits]
    margins = [float(t[0] - t[1]) for t in (z.topk(2).values for z in logits)]
    scales = [float(z.pow(2).mean().sqrt()) for z in logits]
    diff = float((engine.model.dense_logits(ids, engine.cfg.serving.block_size)[0].float() - logits[0]).abs().max())
    return Reference(tokens, margins, scales, diff)


def scenarios(max_prompt: int, budget: int) -> dict[str, tuple[Trace, int]]:
    """name -> (closed trace, max batch rows). Lengths cover one token short of a block, whole blocks, odd sizes."""
    lengths = sorted({1, 5, 16, 17, 40, 64, max_prompt // 2 + 3, max_prompt})
    single = {f"single-{n}": (length_trace([(0.0, n, budget)]), 1) for n in (1, 17, max_prompt)}
    return {
        **single,
        "uniform-4": (length_trace([(0.0, 40, budget)] * 4), 4),
        "mixed-batch": (length_trace([(0.0, n, budget - i % 3) for i, n in enumerate(lengths)]), len(lengths)),
        "8-through-4": (length_trace([(0.0, n, budget - i % 4) for i, n in enumerate(lengths)]), 4),
    }


def _first_difference(have: list[int], want: list[int]) -> int | None:
    i = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
    return i if i is not None or len(have) == len(want) else min(len(have), len(want))


def gate_policies(max_prompt: int) -> tuple[str, ...]:
    """The prefill policies the gate compares with padded: packed, chunks small enough to split long prompts, and
    fused steps of that size (at least a batch's rows)."""
    chunk = max(16, max_prompt // 8)
    return ("packed", f"chunked:{chunk}", f"mixed:{max(chunk, 64)}")


def tight_pool(trace: Trace, block_size: int) -> int:
    """A pool that holds the largest request and a block more: on-demand admission then preempts and recomputes
    whenever several requests run (the gate's `on-demand` variant)."""
    return max(-(-(r.prompt_tokens + r.budget) // block_size) for r in trace.requests) + 1


def run_gate(engine: Engine, budget: int = 12, log=print, only: Collection[str] | None = None,
             prefill: Sequence[str] | None = None, on_demand: bool = True) -> tuple[list[Mismatch], int]:
    """Every scenario (or those named in `only`) on every compiled backend and prefill policy, against the
    reference and against each other. `prefill`: the policies compared with padded (default gate_policies);
    `on_demand`: also on-demand admission on a tight pool (preempted requests recompute), against padded.

    Returns the mismatches and the number of tokens compared.
    """
    ref: dict[tuple[int, int], Reference] = {}
    layers = engine.loaded.spec["num_hidden_layers"]
    unit_roundoff = torch.finfo(getattr(torch, engine.cfg.serving.dtype)).eps / 2
    mismatches, compared = [], 0
    for name, (trace, rows) in scenarios(engine.cfg.max_prompt, budget).items():
        if only is not None and name not in only:
            continue
        got = {}
        for backend in engine.cfg.backends:
            rec = engine.run(trace, None, backend, max_batch=rows, progress=False)
            got[backend] = rec.tokens.sort_values(["request_id", "index"]).groupby("request_id").token_id.apply(list)
        base = engine.cfg.backends[0]
        policies = {}
        variants = {p: {"policy": p} for p in prefill or gate_policies(engine.cfg.max_prompt)}
        if on_demand:
            variants["on-demand"] = {"admission": "on-demand",
                                     "pool_blocks": tight_pool(trace, engine.cfg.serving.block_size)}
        for label, kwargs in variants.items():
            if PrefillPolicy.parse(kwargs.get("policy", "padded")).fuses and int(kwargs["policy"].split(":")[1]) < rows:
                continue  # a fused step holds every row
            rec = engine.run(trace, None, base, max_batch=rows, progress=False, **kwargs)
            policies[label] = rec.tokens.sort_values(["request_id", "index"]).groupby("request_id").token_id.apply(list)
        for r in trace.requests:
            key = (r.prompt_tokens, r.budget)
            if key not in ref:
                ref[key] = reference(engine, r.prompt_tokens, r.budget)
            want = ref[key].tokens
            pairs = [(b, got[b][r.request_id], want) for b in got]
            if len(got) == 2:
                pairs.append(("paged-vs-dense", got["paged"][r.request_id], got["dense"][r.request_id]))
            pairs += [(f"{policy}-vs-padded", tokens[r.request_id], got[base][r.request_id])
                      for policy, tokens in policies.items()]
            for label, have, other in pairs:
                compared += len(other)
                i = _first_difference(have, other)
                if i is not None:
                    j = min(i, len(want) - 1)
                    mismatches.append(Mismatch(name, label, r.request_id, i, have[i] if i < len(have) else -1,
                                               other[i] if i < len(other) else -1, ref[key].margins[j],
                                               ref[key].diff, near_tie_bound(ref[key].scales[j], layers, unit_roundoff)))
        bad = [m for m in mismatches if m.scenario == name]
        log(f"{name:14s} rows={rows:2d} requests={len(trace):2d} backends={'+'.join(got)} "
            f"prefill=padded+{'+'.join(policies)}  "
            f"mismatches={len(bad)} (near ties {sum(m.near_tie for m in bad)})")
    return mismatches, compared
