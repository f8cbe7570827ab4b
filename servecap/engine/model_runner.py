"""Runs the model's prefill and decode steps on the KV pool; both replay CUDA graphs captured at engine start.

The pool is one K and one V tensor [layers, blocks + 1, KV heads, block size, head dim]; the extra block is a
scratch block that pads block tables, so the `padded` decode backend can read past a row's own blocks.

Decode: one graph per (backend, row count) up to max batch; a step is one host-to-device copy and one replay.

Prefill: the step's sequences are packed back to back (a padded group's rows at the padded length, its padding
computed and never stored; a chunk's earlier positions read from the pool) and attend through one varlen Triton
kernel, so the cost of a step is set by its token count and its sequences' lengths, never by a plan built for a
shape. A fused step (mixed:N) is the same pass, but its decode rows attend through the paged decode kernel, as a
decode step's rows do (split over their K/V), while its prompt positions go through the prefill kernel: a decode
row is one query over a long prefix, which a prefill query tile would walk alone. The token count is rounded up to a
bucket: up to GRAPH_TOKENS tokens each bucket is a captured graph (small prefills would otherwise pay for some
three hundred eager launches); above it the step runs eagerly at the bucket's size, and every bucket's matrix
products were run once at start, so no step is the first to load a kernel. Nothing a step does depends on what
ran before it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from servecap.costs.shapes import BACKENDS
from servecap.core.block_pool import blocks_for
from servecap.core.scheduler import PrefillWork, Seq
from servecap.traces.request_tokens import request_token_ids
from servecap.traces.workload import Request

from .kernels import default_num_splits, paged_attention, paged_attention_workspace
from .kernels.prefill_attention import default_block_m, max_programs, plan
from .qwen2 import PagedQwen2

GRAPH_TOKENS = 8192  # prefill steps up to this many tokens replay a graph
EAGER_BUCKET = 1024  # above it, token counts round up to a multiple of this


def prefill_buckets(max_tokens: int, graph_tokens: int = GRAPH_TOKENS) -> list[int]:
    """Token-count buckets: 64-token steps to 2048, 128 to 4096, 256 to graph_tokens, then EAGER_BUCKET steps;
    each rounds a step up by at most about 6% below graph_tokens."""
    steps = [(2048, 64), (4096, 128), (graph_tokens, 256)]
    out, t = [], 0
    while t < max_tokens:
        step = next((s for top, s in steps if t < top), EAGER_BUCKET)
        t += step
        out.append(t)
    return out


@lru_cache(maxsize=1024)
def _prompt_ids(req: Request, vocab: int) -> np.ndarray:
    """A prompt's ids (servecap/traces/prompts.py: from its hash ids where it has them, so equal prefixes are equal
    tokens), made once for the chunks of a prompt that spans several steps."""
    return request_token_ids(req, vocab)


def input_ids(s: Seq, start: int, n: int, vocab: int) -> np.ndarray:
    """The ids at positions start..start+n of a sequence: its prompt's, then the tokens it generated (a recompute
    after a preemption, or a decode row in a fused step, reads those)."""
    p = s.req.prompt_tokens
    if start + n <= p:
        return _prompt_ids(s.req, vocab)[start:start + n]
    generated = np.asarray(s.token_ids[max(0, start - p):start + n - p], dtype=np.int32)
    return np.concatenate([_prompt_ids(s.req, vocab)[start:], generated]) if start < p else generated


class PrefillInputs:
    """One int32 buffer, copied to the device in one go: [ids | positions | slots] for `tokens` token slots,
    then [seq_start | seq_len] for `seqs` sequences, [block_seq | block_q] for the kernel's programs, the index of
    each sequence's last computed token (its logits row), and each sequence's prefix in the pool with its block
    table (chunked prefill), and each fused step's decode row's K/V length (0 for the other sequences), which the
    decode kernel reads through the same block tables."""

    NAMES = ("ids", "pos", "slots", "start", "length", "bseq", "bq", "last", "prefix", "kv_lens", "tables")

    def __init__(self, tokens: int, seqs: int, programs: int, max_blocks: int, device: torch.device, pinned: bool):
        t, s, p = tokens, seqs, programs
        cut = np.cumsum([0, t, t, t, s, s, p, p, s, s, s, s * max_blocks])
        self.host = torch.zeros(int(cut[-1]), dtype=torch.int32, pin_memory=pinned)
        self.np = self.host.numpy()
        self.dev = torch.zeros(int(cut[-1]), dtype=torch.int32, device=device)
        self.views = [self.dev[a:b] for a, b in zip(cut[:-1], cut[1:])]
        self.host_views = [self.np[a:b] for a, b in zip(cut[:-1], cut[1:])]
        self.views[-1] = self.views[-1].view(s, max_blocks)
        self.host_views[-1] = self.host_views[-1].reshape(s, max_blocks)

    def named(self) -> dict[str, np.ndarray]:
        return dict(zip(self.NAMES, self.host_views))

    def for_bucket(self, bucket: int, programs: int) -> list[torch.Tensor]:
        ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens, tables = self.views
        return [ids[:bucket], pos[:bucket], slots[:bucket], start, length, bseq[:programs], bq[:programs], last,
                prefix, kv_lens, tables]


class ModelRunner:
    def __init__(self, model: PagedQwen2, num_blocks: int, block_size: int, max_batch: int, max_tokens: int,
                 max_step_tokens: int, backends=BACKENDS, graphs: bool | None = None):
        self.model = model
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.max_blocks = blocks_for(max_tokens, block_size)
        self.scratch = num_blocks  # id of the pad block
        dev = model.device
        shape = (model.num_layers, num_blocks + 1, model.hkv, block_size, model.head_dim)
        self.k_cache = torch.empty(shape, dtype=model.dtype, device=dev)
        self.v_cache = torch.empty(shape, dtype=model.dtype, device=dev)
        # All decode inputs live in one int32 buffer so a step needs a single host-to-device copy:
        # [token ids | positions | seq lens | slots | block tables (max_batch x max_blocks)].
        b = max_batch
        n = 4 * b + b * self.max_blocks
        pinned = dev.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int32, device=dev)
        self.ids, self.pos, self.lens, self.slots = (self._dev[i * b:(i + 1) * b] for i in range(4))
        self.tables = self._dev[4 * b:].view(b, self.max_blocks)
        self.splits = {r: default_num_splits(r, model.hkv, max_blocks=self.max_blocks) for r in range(1, b + 1)}
        self.workspaces = {k: paged_attention_workspace(b, model.hq, model.head_dim, k, dev)
                           for k in set(self.splits.values()) if k > 1}
        self.out_tokens = torch.zeros(b, dtype=torch.int64, device=dev)
        # Whose block table each host row holds now, and how many of its blocks: a row is rewritten only when it
        # changes hands or its table grows (on-demand admission).
        self._table_owner: list[tuple[Seq | None, int]] = [(None, 0)] * b
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}

        # Prefill: buckets, the kernel's tile, static inputs for the graph buckets, and the first tokens.
        self.block_m = default_block_m(dev)
        self.buckets = prefill_buckets(max_step_tokens)
        use_graphs = dev.type == "cuda" if graphs is None else graphs
        graph_top = max([t for t in self.buckets if t <= GRAPH_TOKENS], default=0) if use_graphs else 0
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same buckets, for fused steps
        self.max_seqs = b + 1  # the step's sequences, and the bucket's padding as one more
        # Static inputs: one set for the graphs' buckets, one for the eager ones (each at its largest bucket), so no
        # step allocates pinned or device memory of a size it has not seen.
        self._prefill_in = PrefillInputs(graph_top, self.max_seqs, self._programs(graph_top), self.max_blocks, dev,
                                         pinned) if graph_top else None
        top = self.buckets[-1]
        self._eager_in = PrefillInputs(top, self.max_seqs, self._programs(top), self.max_blocks, dev, pinned) \
            if top > graph_top else None
        self.prefill_tokens = torch.zeros(self.max_seqs, dtype=torch.int64, device=dev)
        if use_graphs:
            self._capture(backends, graph_top)
        if dev.type == "cuda":
            self._warm_eager(graph_top)

    # ---- decode -------------------------------------------------------------------------------------
    def _decode_forward(self, rows: int, backend: str) -> None:
        m, s = self.model, self.splits[rows]
        ws = self.workspaces.get(s)

        def attend(i, q, k, v):
            o = paged_attention(q, self.k_cache[i], self.v_cache[i], self.tables, self.lens, m.scale, num_splits=s,
                                pad_to_span=backend == "dense", workspace=ws)
            return o.view(rows, m.hq * m.head_dim)

        logits = m.forward(self.ids[:rows], self.pos[:rows], self.slots[:rows], self.k_cache, self.v_cache, attend,
                           slice(None))
        self.out_tokens[:rows].copy_(logits.argmax(-1))

    def _capture(self, backends, graph_top: int) -> None:
        """Every graph, largest first so the smaller ones reuse its memory: prefill buckets, then decode rows."""
        self.tables.fill_(self.scratch)
        self.lens.fill_(1)
        pool = None

        def capture(fn):
            nonlocal pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # compiles and loads every kernel outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                fn()
            pool = g.pool()
            # A graph's first launch also uploads it to the device (a step's few hundred kernels): paid here, not by
            # the first step that lands in its bucket. The inputs are the capture's: the prefill idle inputs store
            # nothing, and decode rewrites the one slot its eager warm-up wrote.
            g.replay()
            return g

        for bucket in sorted((t for t in self.buckets if t <= graph_top), reverse=True):
            self._fill_idle_prefill(bucket)
            self.prefill_graphs[bucket] = capture(lambda: self._prefill_forward(bucket))
            self.mixed_graphs[bucket] = capture(lambda: self._prefill_forward(bucket, fused=True))
        for backend in backends:
            for rows in range(self.max_batch, 0, -1):
                self.graphs[backend, rows] = capture(lambda: self._decode_forward(rows, backend))
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
            owner, held = self._table_owner[i]
            if owner is not s or held != len(s.block_table):
                self._table_owner[i] = (s, len(s.block_table))
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
    def bucket(self, tokens: int) -> int:
        i = int(np.searchsorted(self.buckets, tokens))
        if i == len(self.buckets):
            raise ValueError(f"a prefill step of {tokens} tokens is beyond the engine's {self.buckets[-1]}")
        return self.buckets[i]

    def _programs(self, bucket: int) -> int:
        return max_programs(bucket, self.max_seqs, self.block_m)

    def _prefill_forward(self, bucket: int, inputs: list[torch.Tensor] | None = None, fused: bool = False) -> None:
        m = self.model
        ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens, tables = inputs or \
            self._prefill_in.for_bucket(bucket, self._programs(bucket))
        decode = None
        if fused:  # the decode rows lead the step's tokens, one each: the decode kernel over the first rows
            rows = min(self.max_batch, bucket)
            splits = self.splits[rows]
            decode = (kv_lens[:rows], tables[:rows], self.k_cache, self.v_cache, splits, self.workspaces.get(splits))
        attend = m.prefill_attend(start, length, bseq, bq, self.block_m, (prefix, tables, self.k_cache, self.v_cache),
                                  decode)
        logits = m.forward(ids, pos, slots, self.k_cache, self.v_cache, attend, last)
        self.prefill_tokens.copy_(logits.argmax(-1))

    def _fill_idle_prefill(self, bucket: int) -> None:
        """Inputs that run a bucket's full work (one sequence of its length) and store nothing: for warm-ups."""
        pi = self._prefill_in
        h = pi.named()
        p = plan([bucket], self.block_m, len(h["bseq"]))
        h["ids"][:], h["pos"][:], h["slots"][:] = 0, 0, -1
        h["pos"][:bucket] = np.arange(bucket) % self.max_tokens  # a bucket may be longer than the model's positions
        h["start"][:], h["length"][:], h["prefix"][:], h["kv_lens"][:] = 0, 0, 0, 0
        h["length"][0] = bucket
        h["bseq"][:], h["bq"][:] = p.block_seq, p.block_q
        h["last"][:] = bucket - 1
        pi.dev.copy_(pi.host)

    def _warm_eager(self, graph_top: int) -> None:
        """Run each eager bucket's matrix products once, so none is first loaded inside a measured step."""
        m = self.model
        L = m.layers[0]
        for bucket in (t for t in self.buckets if t > graph_top):
            x = torch.randn(bucket, m.embed.shape[1], dtype=m.dtype, device=m.device)
            torch.nn.functional.linear(x, L.qkv_w, L.qkv_b)
            h = torch.nn.functional.linear(x, L.gate_up_w)
            torch.nn.functional.linear(h[:, :L.down_w.shape[1]].contiguous(), L.down_w)
            torch.nn.functional.linear(x, L.o_w)
        torch.cuda.synchronize()

    def prefill(self, work: PrefillWork) -> list[int]:
        """Run a prefill step; returns the first token of each prompt it completes, in the step's order."""
        m, bs = self.model, self.block_size
        total = sum(work.computed)
        bucket = self.bucket(total)
        fused = work.decode > 0
        graph = (self.mixed_graphs if fused else self.prefill_graphs).get(bucket)
        pi = self._prefill_in if graph is not None else self._eager_in
        ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens, tables = pi.host_views
        ids[:bucket], pos[:bucket], slots[:bucket] = 0, 0, -1
        start[:], length[:], last[:], prefix[:], kv_lens[:] = 0, 0, 0, 0, 0
        completes, off = [], 0
        for i, s in enumerate(work.seqs):
            p, n, c = work.prefix[i], work.new[i], work.computed[i]
            ids[off:off + n] = input_ids(s, p, n, m.vocab)
            pos[off:off + c] = np.arange(p, p + c)
            j = np.arange(p, p + n)
            slots[off:off + n] = np.asarray(s.block_table, dtype=np.int32)[j // bs] * bs + j % bs
            start[i] = off
            if i < work.decode:  # the decode kernel's row: its K/V with the token it writes now; no prefill tile
                kv_lens[i] = p + 1
                tables[i, :len(s.block_table)] = s.block_table
                tables[i, len(s.block_table):] = self.scratch
            else:
                length[i] = c
                if p:  # a later chunk attends to the prompt's earlier positions through its block table
                    prefix[i] = p
                    tables[i, :len(s.block_table)] = s.block_table
            if work.completes(i):
                last[len(completes)] = off + n - 1
                completes.append(s)
            off += c
        lengths = [0] * work.decode + list(work.computed[work.decode:])
        if bucket > total:  # the bucket's padding attends within itself, so no unset memory enters a product
            i = len(lengths)
            start[i], length[i] = total, bucket - total  # its tokens: id 0 at position 0
            lengths.append(bucket - total)
        programs = self._programs(bucket)
        p = plan(lengths, self.block_m, programs)
        bseq[:programs], bq[:programs] = p.block_seq, p.block_q
        pi.dev.copy_(pi.host, non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_forward(bucket, pi.for_bucket(bucket, programs), fused)
        # Read them all: the step's one host sync, also when no prompt completes (a chunk of a longer one), so the
        # step's time is its own and not the next step's.
        return self.prefill_tokens.tolist()[:len(completes)]
