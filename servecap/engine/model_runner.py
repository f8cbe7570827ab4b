"""Runs the model's prefill and decode steps on the KV pool; both replay CUDA graphs captured at engine start.

The pool is one K and one V tensor [layers, blocks + 1, KV heads, block size, head dim]; the extra block is a
scratch block that pads block tables, so the `padded` decode backend can read past a row's own blocks.

Decode: one graph per (backend, row count) up to max batch. A pass's decode steps of the same rows run as a stretch
the host launches ahead of the device (launch_decode, launch_next): the first step's inputs come in one host-to-device
copy, every later step's from the step before it on the device (its token, one position on, the slot that position's
K/V goes to: one small graph, `advance`), so the host's own work between steps (reading a step's end, writing the
records, the scheduler) overlaps the device's instead of adding to it. A step's tokens stay on the device until the
stretch ends. A stretch's first step may be launched right behind the pass's prefill step: the rows that step
completes take their first token from its output on the device, and the host reads the prefill step's end and
tokens from an event and a copy of its own, so that read waits for no later step.

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

from bisect import bisect_left
from functools import lru_cache
from typing import Iterable

import numpy as np
import torch

from servecap.costs.shapes import BACKENDS
from servecap.core.block_pool import blocks_for
from servecap.core.scheduler import PrefillWork, Seq, steps_in_blocks
from servecap.traces.request_tokens import request_token_ids
from servecap.traces.workload import Request

from .kernels import default_num_splits, paged_attention, paged_attention_workspace
from .kernels.prefill_attention import default_block_m, max_programs, plan
from .qwen2 import PagedQwen2

GRAPH_TOKENS = 8192  # prefill steps up to this many tokens replay a graph
EAGER_BUCKET = 1024  # above it, token counts round up to a multiple of this
STRETCH_STEPS = 256  # the most decode steps a stretch runs with no host input: their tokens wait on the device
PROMPT_CACHE = 1024  # prompts whose ids are kept made (a queue's head, the prompts being prefilled in chunks)


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


@lru_cache(maxsize=PROMPT_CACHE)
def _prompt_ids(req: Request, vocab: int) -> np.ndarray:
    """A prompt's ids (servecap/traces/prompts.py: from its hash ids where it has them, so equal prefixes are equal
    tokens), made once for the chunks of a prompt that spans several steps."""
    return request_token_ids(req, vocab)


@lru_cache(maxsize=4096)
def _tile_plan(lengths: tuple[int, ...], block_m: int, programs: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's query tiles (block_seq, block_q) for its sequences' lengths: a fused step's lengths repeat (its
    decode rows, one position each, and a chunk that fills the step), and planning them is most of a launch's host
    work. Read-only: callers copy them."""
    p = plan(lengths, block_m, programs)
    return p.block_seq, p.block_q


def input_ids(s: Seq, start: int, n: int, vocab: int) -> np.ndarray:
    """The ids at positions start..start+n of a sequence: its prompt's, then the tokens it generated (a recompute
    after a preemption, or a decode row in a fused step, reads those)."""
    p = s.req.prompt_tokens
    if start + n <= p:
        return _prompt_ids(s.req, vocab)[start:start + n]
    generated = np.asarray(s.token_ids[max(0, start - p):start + n - p], dtype=np.int32)
    return np.concatenate([_prompt_ids(s.req, vocab)[start:], generated]) if start < p else generated


class BlockTableRows:
    """Rows of a host buffer of block tables (a pad block after each table's end), each rewritten only when it is
    to hold another table (another sequence's, or a new admission's: a new list) or a longer one (on-demand
    growth extends the list): a step's rows are mostly the last step's, in the same order."""

    def __init__(self, rows: np.ndarray, scratch: int):
        self.rows, self.scratch = rows, scratch
        self._held: list[tuple[list[int] | None, int]] = [(None, 0)] * len(rows)

    def put(self, i: int, table: list[int]) -> None:
        held, n = self._held[i]
        if held is not table or n != len(table):
            self._held[i] = (table, len(table))
            self.rows[i, :len(table)] = table
            self.rows[i, len(table):] = self.scratch


class PrefillInputs:
    """One int32 buffer, copied to the device in one go: [ids | positions | slots] for `tokens` token slots,
    then [seq_start | seq_len] for `seqs` sequences, [block_seq | block_q] for the kernel's programs, the index of
    each sequence's last computed token (its logits row), and each sequence's prefix in the pool with its block
    table (chunked prefill), and each fused step's decode row's K/V length (0 for the other sequences), which the
    decode kernel reads through the same block tables."""

    NAMES = ("ids", "pos", "slots", "start", "length", "bseq", "bq", "last", "prefix", "kv_lens", "tables")

    def __init__(self, tokens: int, seqs: int, programs: int, max_blocks: int, scratch: int, device: torch.device,
                 pinned: bool):
        t, s, p = tokens, seqs, programs
        cut = np.cumsum([0, t, t, t, s, s, p, p, s, s, s, s * max_blocks])
        self.host = torch.zeros(int(cut[-1]), dtype=torch.int32, pin_memory=pinned)
        self.np = self.host.numpy()
        self.dev = torch.zeros(int(cut[-1]), dtype=torch.int32, device=device)
        self.views = [self.dev[a:b] for a, b in zip(cut[:-1], cut[1:])]
        self.host_views = [self.np[a:b] for a, b in zip(cut[:-1], cut[1:])]
        self.views[-1] = self.views[-1].view(s, max_blocks)
        self.host_views[-1] = self.host_views[-1].reshape(s, max_blocks)
        self.tables = BlockTableRows(self.host_views[-1], scratch)

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
        # [token ids | positions | seq lens | slots | fed | block tables (max_batch x max_blocks)]; fed[i] is the
        # index of row i's token among the last prefill step's first tokens (-1: its token is in ids).
        b = max_batch
        n = 5 * b + b * self.max_blocks
        pinned = dev.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.int32, device=dev)
        self.ids, self.pos, self.lens, self.slots, self.fed = (self._dev[i * b:(i + 1) * b] for i in range(5))
        self.tables = self._dev[5 * b:].view(b, self.max_blocks)
        self.splits = {r: default_num_splits(r, model.hkv, max_blocks=self.max_blocks) for r in range(1, b + 1)}
        self.workspaces = {k: paged_attention_workspace(b, model.hq, model.head_dim, k, dev)
                           for k in set(self.splits.values()) if k > 1}
        self.out_tokens = torch.zeros(b, dtype=torch.int64, device=dev)
        # A stretch's steps' tokens, the last one's in out_tokens; each step's end, read by the host as it comes.
        self.stretch_tokens = torch.zeros(STRETCH_STEPS, b, dtype=torch.int64, device=dev)
        self.asynchronous = dev.type == "cuda"  # launches return before the work is done
        self._ends = [torch.cuda.Event() for _ in range(STRETCH_STEPS)] if self.asynchronous else []
        self._stretch: tuple[int, str] = (0, "paged")  # rows and backend of the stretch being run
        self._tables = BlockTableRows(self._host_np[5 * b:].reshape(b, self.max_blocks), self.scratch)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.advance_graphs: dict[int, torch.cuda.CUDAGraph] = {}

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
        self._prefill_in = PrefillInputs(graph_top, self.max_seqs, self._programs(graph_top), self.max_blocks,
                                         self.scratch, dev, pinned) if graph_top else None
        top = self.buckets[-1]
        self._eager_in = PrefillInputs(top, self.max_seqs, self._programs(top), self.max_blocks, self.scratch, dev,
                                       pinned) if top > graph_top else None
        self.prefill_tokens = torch.zeros(self.max_seqs, dtype=torch.int64, device=dev)
        # Read by the host from its own copy, made behind the step, so that reading it waits for that step alone
        # (the decode step launched behind it may still run).
        self._prefill_read = torch.zeros(self.max_seqs, dtype=torch.int64, pin_memory=pinned)
        self._prefill_end = torch.cuda.Event() if self.asynchronous else None
        self._completes = 0  # prompts the launched prefill step completes
        # Each prompt it completes: its token's index, until the host reads the tokens (prefill_result) or a decode
        # step launched before then takes them on the device. After the read the host has them: a launch then writes
        # them with the rest of its inputs, as feeding them on the device costs a few eager ops of host time, in the
        # open there (the decode step after a fused step was longer when it fed: results/validation-v26-serving).
        self._fed: dict[Seq, int] = {}
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
        for rows in range(self.max_batch, 0, -1):
            self.advance_graphs[rows] = capture(lambda: self._advance(rows))
        torch.cuda.synchronize()

    def _advance(self, rows: int) -> None:
        """The next decode step's inputs from the last one's, on the device: the token each row generated, one
        position on, and the slot in its block table that position's K/V goes to."""
        bs = self.block_size
        self.ids[:rows].copy_(self.out_tokens[:rows])
        self.pos[:rows] += 1
        self.lens[:rows] += 1
        pos = self.pos[:rows].long()
        block = self.tables[:rows].gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
        self.slots[:rows].copy_(block * bs + pos % bs)

    def stretch_cap(self, rows: list[Seq]) -> int:
        """The most decode steps `rows` can run with no host input: while every row's next position has its block
        (tables grow between passes under on-demand admission), and at most STRETCH_STEPS."""
        return min(STRETCH_STEPS, steps_in_blocks(rows, self.block_size))

    def launch_decode(self, rows: list[Seq], backend: str) -> None:
        """Launch the first decode step of a stretch for `rows`: each writes its last token's K/V and generates
        its next token. Launched before the host has read the last prefill step's tokens (EngineTimer.prefill
        launches it right behind that step), the rows that step completed take their token from its output on the
        device."""
        n, b, bs = len(rows), self.max_batch, self.block_size
        h, put, first = self._host_np, self._tables.put, self._fed
        token, pos, slot, fed = [0] * n, [0] * n, [0] * n, [-1] * n
        for i, s in enumerate(rows):
            p, table = s.kv_len, s.block_table
            k = first.get(s, -1)
            if k < 0:
                token[i] = s.token_ids[-1]
            pos[i], slot[i], fed[i] = p, table[p // bs] * bs + p % bs, k
            put(i, table)
        h[:n], h[b:b + n], h[2 * b:2 * b + n], h[3 * b:3 * b + n], h[4 * b:4 * b + n] = token, pos, pos, slot, fed
        h[2 * b:2 * b + n] += 1
        self._dev.copy_(self._host, non_blocking=True)
        if first:
            self._feed(n)
            self._fed = {}
        self._stretch = (n, backend)
        self._decode_step(0)

    def _feed(self, n: int) -> None:
        """Rows whose token the last prefill step made take it from that step's output, on the device."""
        fed = self.fed[:n]
        self.ids[:n] = torch.where(fed >= 0, self.prefill_tokens[fed.clamp(min=0).long()].to(self.ids.dtype),
                                   self.ids[:n])

    def launch_next(self, j: int) -> None:
        """Launch step j + 1 of the stretch (j >= 1 launched already), its inputs from step j's on the device."""
        n, _ = self._stretch
        self.stretch_tokens[j - 1].copy_(self.out_tokens)
        g = self.advance_graphs.get(n)
        if g is not None:
            g.replay()
        else:
            self._advance(n)
        self._decode_step(j)

    def _decode_step(self, j: int) -> None:
        n, backend = self._stretch
        g = self.graphs.get((backend, n))
        if g is not None:
            g.replay()
        else:
            self._decode_forward(n, backend)
        if self.asynchronous:
            self._ends[j].record()

    def wait(self, j: int) -> None:
        """Return once step j + 1 of the stretch has ended (launched steps end in order)."""
        if self.asynchronous:
            self._ends[j].synchronize()

    def stretch_result(self, steps: int) -> list[list[int]]:
        """The tokens of the stretch's `steps` steps (all launched), per row in step order; waits for the last."""
        n, _ = self._stretch
        out = torch.cat([self.stretch_tokens[:steps - 1, :n], self.out_tokens[None, :n]]).T
        return out.tolist()

    # ---- prefill ------------------------------------------------------------------------------------
    def bucket(self, tokens: int) -> int:
        i = bisect_left(self.buckets, tokens)
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
        """Run each eager bucket's matrix products and the decode launch's token feed once, so none is first loaded
        inside a measured step (a fresh engine's first feed loads its kernels: results/validation-v26-serving)."""
        self._feed(self.max_batch)  # fed is all 0 here: every row's id from the first token slot, rewritten at launch
        m = self.model
        L = m.layers[0]
        for bucket in (t for t in self.buckets if t > graph_top):
            x = torch.randn(bucket, m.embed.shape[1], dtype=m.dtype, device=m.device)
            torch.nn.functional.linear(x, L.qkv_w, L.qkv_b)
            h = torch.nn.functional.linear(x, L.gate_up_w)
            torch.nn.functional.linear(h[:, :L.down_w.shape[1]].contiguous(), L.down_w)
            torch.nn.functional.linear(x, L.o_w)
        torch.cuda.synchronize()

    def prepare(self, seqs: Iterable[Seq]) -> None:
        """Make the prompt ids of sequences a later step will prefill (the queue's head), while the device runs a
        step, so that step's launch does not wait for them."""
        for s in seqs:
            _prompt_ids(s.req, self.model.vocab)

    def launch_prefill(self, work: PrefillWork) -> None:
        """Launch a prefill step; prefill_result gives the first token of each prompt it completes."""
        m, bs = self.model, self.block_size
        total = sum(work.computed)
        bucket = self.bucket(total)
        fused = work.decode > 0
        graph = (self.mixed_graphs if fused else self.prefill_graphs).get(bucket)
        pi = self._prefill_in if graph is not None else self._eager_in
        ids, pos, slots, start, length, bseq, bq, last, prefix, kv_lens, tables = pi.host_views
        ids[:bucket], pos[:bucket], slots[:bucket] = 0, 0, -1
        start[:], length[:], last[:], prefix[:], kv_lens[:] = 0, 0, 0, 0, 0
        d = work.decode
        completes = []  # indices in the step of the sequences it completes, in its order
        if d:  # a fused step's decode rows, one position each: their last token, at their K/V's end
            at, put, done = work.prefix[:d], pi.tables.put, work.done
            token, slot = [0] * d, [0] * d
            for i, s in enumerate(work.seqs[:d]):
                q, table = at[i], s.block_table
                token[i] = s.token_ids[q - s.req.prompt_tokens]
                slot[i] = table[q // bs] * bs + q % bs
                put(i, table)
                if done[i]:
                    completes.append(i)
            ids[:d], pos[:d], slots[:d] = token, at, slot
            start[:d] = np.arange(d)
            kv_lens[:d] = at
            kv_lens[:d] += 1
            last[:len(completes)] = completes
        off = d
        for i in range(d, len(work.seqs)):
            s, p, n, c = work.seqs[i], work.prefix[i], work.new[i], work.computed[i]
            ids[off:off + n] = input_ids(s, p, n, m.vocab)
            pos[off:off + c] = np.arange(p, p + c)
            j = np.arange(p, p + n)
            slots[off:off + n] = np.asarray(s.block_table, dtype=np.int32)[j // bs] * bs + j % bs
            start[i] = off
            length[i] = c
            if p:  # a later chunk attends to the prompt's earlier positions through its block table
                prefix[i] = p
                pi.tables.put(i, s.block_table)
            if work.done[i]:
                last[len(completes)] = off + n - 1
                completes.append(i)
            off += c
        lengths = (0,) * work.decode + work.shape.computed[work.decode:]
        if bucket > total:  # the bucket's padding attends within itself, so no unset memory enters a product
            i = len(lengths)
            start[i], length[i] = total, bucket - total  # its tokens: id 0 at position 0
            lengths += (bucket - total,)
        programs = self._programs(bucket)
        bseq[:programs], bq[:programs] = _tile_plan(lengths, self.block_m, programs)
        pi.dev.copy_(pi.host, non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_forward(bucket, pi.for_bucket(bucket, programs), fused)
        self._prefill_read.copy_(self.prefill_tokens, non_blocking=True)
        if self._prefill_end is not None:
            self._prefill_end.record()
        seqs = work.seqs
        self._completes = len(completes)
        self._fed = {seqs[i]: k for k, i in enumerate(completes)}

    def prefill_result(self) -> list[int]:
        """The first token of each prompt the launched prefill step completes, in the step's order; it waits for
        that step's end and no later step's, also when the step completes no prompt (a chunk of a longer one), so
        the step's time is its own."""
        if self._prefill_end is not None:
            self._prefill_end.synchronize()
        self._fed = {}
        return self._prefill_read.tolist()[:self._completes]
