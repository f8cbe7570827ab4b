"""Runs the model's prefill and decode steps on the KV pool; decode replays CUDA graphs.

The pool is one K and one V tensor [layers, blocks + 1, KV heads, block size, head dim]; the extra block
is a scratch block that pads block tables, so the `padded` backend can read past a row's own blocks.
Decode steps are captured as CUDA graphs at engine start, one per (backend, row count) for every row
count up to max batch, so a step is one graph replay plus one host-to-device copy of its inputs and no
step ever includes compilation.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from traces.prompts import QWEN_TEXT_VOCAB, prompt_tokens

from .kernels import default_num_splits, paged_attention, paged_attention_workspace
from .model import PagedQwen2
from .recorder import BACKENDS
from .scheduler import Seq


@lru_cache(maxsize=64)
def _prompt_ids(length: int, vocab: int) -> np.ndarray:
    return np.asarray(prompt_tokens(length, min(vocab, QWEN_TEXT_VOCAB)), dtype=np.int64)


class ModelRunner:
    def __init__(self, model: PagedQwen2, num_blocks: int, block_size: int, max_batch: int, max_tokens: int,
                 backends=BACKENDS, graphs: bool | None = None):
        self.model = model
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.max_blocks = -(-max_tokens // block_size)
        self.scratch = num_blocks  # id of the pad block
        dev = model.device
        shape = (model.num_layers, num_blocks + 1, model.hkv, block_size, model.head_dim)
        self.k_cache = torch.empty(shape, dtype=model.dtype, device=dev)
        self.v_cache = torch.empty(shape, dtype=model.dtype, device=dev)
        # All decode inputs live in one int32 buffer so a step needs a single host-to-device copy:
        # [token ids | positions | seq lens | slots | block tables (max_batch x max_blocks)].
        b = max_batch
        n = 4 * b + b * self.max_blocks
        self._host = torch.zeros(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int32, device=dev)
        self.ids, self.pos, self.lens, self.slots = (self._dev[i * b:(i + 1) * b] for i in range(4))
        self.tables = self._dev[4 * b:].view(b, self.max_blocks)
        self.splits = {r: default_num_splits(r, model.hkv, max_blocks=self.max_blocks) for r in range(1, b + 1)}
        self.workspaces = {k: paged_attention_workspace(b, model.hq, model.head_dim, k, dev)
                           for k in set(self.splits.values()) if k > 1}
        self.out_tokens = torch.zeros(b, dtype=torch.int64, device=dev)
        self._table_owner: list[Seq | None] = [None] * b  # whose block table each host row holds now
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        use_graphs = dev.type == "cuda" if graphs is None else graphs
        if use_graphs:
            self._capture(backends)

    # ---- decode -------------------------------------------------------------------------------------
    def _decode_forward(self, rows: int, backend: str) -> None:
        m, s = self.model, self.splits[rows]
        ws = self.workspaces.get(s)

        def attend(i, q, k, v):
            o = paged_attention(q, self.k_cache[i], self.v_cache[i], self.tables, self.lens, m.scale, num_splits=s,
                                pad_to_span=backend == "padded", workspace=ws)
            return o.view(rows, m.hq * m.head_dim)

        logits = m.forward(self.ids[:rows], self.pos[:rows], self.slots[:rows], self.k_cache, self.v_cache, attend,
                           slice(None))
        self.out_tokens[:rows].copy_(logits.argmax(-1))

    def _capture(self, backends) -> None:
        self.tables.fill_(self.scratch)
        self.lens.fill_(1)
        pool = None
        for backend in backends:
            for rows in range(self.max_batch, 0, -1):  # largest first so smaller graphs reuse its memory
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._decode_forward(rows, backend)  # compiles the kernels outside the graph
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._decode_forward(rows, backend)
                pool = g.pool()
                self.graphs[backend, rows] = g
        torch.cuda.synchronize()

    def decode(self, rows: list[Seq], backend: str) -> list[int]:
        """One decode step for `rows`: each writes its last token's K/V and gets its next token."""
        n, b, bs = len(rows), self.max_batch, self.block_size
        h = self._host_np
        tables = h[4 * b:].reshape(b, self.max_blocks)
        for i, s in enumerate(rows):
            pos = s.kv_len
            h[i] = s.token_ids[-1]
            h[b + i] = pos
            h[2 * b + i] = pos + 1
            h[3 * b + i] = s.block_table[pos // bs] * bs + pos % bs
            if self._table_owner[i] is not s:  # a table is fixed at admission: rewrite a row only when it changes hands
                self._table_owner[i] = s
                tables[i, :len(s.block_table)] = s.block_table
                tables[i, len(s.block_table):] = self.scratch
        self._dev.copy_(self._host, non_blocking=True)
        g = self.graphs.get((backend, n))
        if g is not None:
            g.replay()
        else:
            self._decode_forward(n, backend)
        return self.out_tokens[:n].tolist()  # the step's one host sync

    # ---- prefill ------------------------------------------------------------------------------------
    def prefill(self, group: list[Seq]) -> list[int]:
        """Prefill an admission group padded to its widest prompt; returns each row's first token."""
        m, bs = self.model, self.block_size
        g = len(group)
        width = max(s.req.prompt_tokens for s in group)
        ids = np.zeros((g, width), dtype=np.int64)
        slots = np.full((g, width), -1, dtype=np.int64)
        last = np.empty(g, dtype=np.int64)
        for i, s in enumerate(group):
            n = s.req.prompt_tokens
            ids[i, :n] = _prompt_ids(n, m.vocab)
            j = np.arange(n)
            slots[i, :n] = np.asarray(s.block_table, dtype=np.int64)[j // bs] * bs + j % bs
            last[i] = i * width + n - 1
        dev = m.device
        host = torch.from_numpy(np.concatenate([ids.ravel(), slots.ravel(), last]))
        flat = host.to(dev, non_blocking=True)
        t = g * width
        ids_d, slots_d, last_d = flat[:t], flat[t:2 * t], flat[2 * t:]
        positions = torch.arange(width, device=dev).repeat(g)
        logits = m.forward(ids_d, positions, slots_d, self.k_cache, self.v_cache, m.prefill_attend(g, width), last_d)
        return logits.argmax(-1).tolist()
