"""A compact Qwen2 forward pass over the paged KV pool, sharing the HF model's weights.

QKV and gate/up projections are fused into one matmul each; RoPE and the K/V store are one kernel;
residual add and RMSNorm are one kernel. Prefill and decode run the same layer stack and differ only
in attention: prefill runs causal attention within each of the step's packed sequences (servecap/engine/kernels/
prefill_attention.py), decode reads the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .kernels import add_rms_norm, paged_attention, rms_norm, rope_cos_sin, rope_kv, silu_mul
from .kernels.prefill_attention import default_block_m, plan, prefill_attention
from .weights import LoadedModel


@dataclass
class Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    o_w: torch.Tensor
    ln2: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


# attend(layer index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PagedQwen2:
    def __init__(self, loaded: LoadedModel, max_positions: int):
        hf, s = loaded.hf, loaded.spec
        self.num_layers, self.hq, self.hkv, self.head_dim = (s["num_hidden_layers"], s["num_attention_heads"],
                                                             s["num_key_value_heads"], s["head_dim"])
        self.eps = s["rms_norm_eps"]
        self.vocab = s["vocab_size"]
        self.dtype = hf.model.embed_tokens.weight.dtype
        self.device = hf.model.embed_tokens.weight.device
        self.scale = self.head_dim ** -0.5
        with torch.no_grad():
            self.embed = hf.model.embed_tokens.weight
            self.norm = hf.model.norm.weight
            self.lm_head = hf.lm_head.weight  # the embedding itself when tied
            self.layers = []
            for layer in hf.model.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(Layer(
                    ln1=layer.input_layernorm.weight,
                    qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_b=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                    o_w=a.o_proj.weight, ln2=layer.post_attention_layernorm.weight,
                    gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]), down_w=m.down_proj.weight))
        self.cos_sin = rope_cos_sin(self.head_dim, max_positions, s["rope_theta"], self.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attend: Attend, last: torch.Tensor | slice) -> torch.Tensor:
        """Logits [len(last), vocab] for the tokens at `last`; writes every token with a slot >= 0 into the pool."""
        x = F.embedding(ids, self.embed)
        n, kv = ids.shape[0], self.hkv * self.head_dim
        residual = None
        for i, L in enumerate(self.layers):
            if residual is None:
                h, residual = rms_norm(x, L.ln1, self.eps), x
            else:
                h, residual = add_rms_norm(x, residual, L.ln1, self.eps)
            qkv = F.linear(h, L.qkv_w, L.qkv_b)
            q, k = rope_kv(qkv, positions, self.cos_sin, k_cache[i], v_cache[i], slots)
            v = qkv[:, self.hq * self.head_dim + kv:].view(n, self.hkv, self.head_dim)
            x = F.linear(attend(i, q, k, v), L.o_w)
            h, residual = add_rms_norm(x, residual, L.ln2, self.eps)
            x = F.linear(silu_mul(F.linear(h, L.gate_up_w)), L.down_w)
        h, _ = add_rms_norm(x[last], residual[last], self.norm, self.eps)
        return F.linear(h, self.lm_head)

    def dense_logits(self, ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
        """Last-position logits [G, vocab] of prompts ids [G, W] through the prefill path, touching no pool."""
        g, width = ids.shape
        scratch = torch.empty((self.num_layers, 1, self.hkv, block_size, self.head_dim), dtype=self.dtype,
                              device=self.device)
        flat = ids.reshape(-1).to(self.device)
        positions = torch.arange(width, device=self.device).repeat(g)
        last = torch.arange(width - 1, g * width, width, device=self.device)
        block_m = default_block_m(self.device)
        p = plan([width] * g, block_m)
        start, length, bseq, bq = (torch.from_numpy(a).to(self.device) for a in (p.seq_start, p.seq_len, p.block_seq,
                                                                                  p.block_q))
        return self.forward(flat, positions, torch.full_like(flat, -1), scratch, scratch,
                            self.prefill_attend(start, length, bseq, bq, block_m), last)

    def prefill_attend(self, seq_start: torch.Tensor, seq_len: torch.Tensor, block_seq: torch.Tensor,
                       block_q: torch.Tensor, block_m: int, prefix: tuple | None = None,
                       decode: tuple | None = None) -> Attend:
        """Causal attention within each packed sequence (seq_start, seq_len), over the kernel's work list; with
        `prefix` = (prefix_len, block_tables, k_cache, v_cache), also over each sequence's positions in the pool.
        With `decode` = (kv_lens, block_tables, k_cache, v_cache, num_splits, workspace), the first len(kv_lens)
        tokens are also one query each over their first kv_lens[i] positions in the pool, through the paged decode
        kernel (a fused step's decode rows, which the work list leaves out; a row of length 0 is another
        sequence's token, which the prefill kernel then writes)."""
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool, out = {}, torch.empty_like(q)
            if prefix is not None:
                prefix_len, tables, k_cache, v_cache = prefix
                pool = dict(prefix_len=prefix_len, block_tables=tables, k_cache=k_cache[i], v_cache=v_cache[i])
            if decode is not None:
                kv_lens, tables, k_cache, v_cache, splits, workspace = decode
                rows = kv_lens.shape[0]
                paged_attention(q[:rows], k_cache[i], v_cache[i], tables, kv_lens, self.scale, num_splits=splits,
                                out=out[:rows], workspace=workspace)
            o = prefill_attention(q, k, v, seq_start, seq_len, block_seq, block_q, self.scale, block_m=block_m,
                                  out=out, **pool)
            return o.view(q.shape[0], self.hq * self.head_dim)
        return attend
