"""Attention micro-benchmarks on a CUDA GPU: `python -m engine.kernels.bench [--only decode|prefill] [--sweep] ...`.

Qwen2.5-1.5B shapes (12 q heads over 2 kv heads, head_dim 128, fp16). Each call is captured in a CUDA graph and
timed by triton's do_bench (median, L2 flushed before each rep).

Decode: random KV in shuffled 64-token blocks (the flush is as a decode step finds it: the layers between two
reads of one layer's KV evict it). Reference: torch's flash SDPA on the same KV laid out densely, with each kv
head's query group as G query rows of one head (the same math as GQA decode, without copying KV per query head).
--warps and --stages tune the decode kernel; --sweep times blocks a split x warps x stages at the engine's
block-table width.

Prefill: groups of equal-length sequences, packed for the prefill kernel; the reference is torch's flash SDPA
(causal, GQA) on the same memory viewed as [groups, heads, length, D], as the model's padded prefill calls it.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from servecap.traces.command import Parser, command

pa = importlib.import_module(".paged_attention", __package__)  # the package's `paged_attention` is the function
pfa = importlib.import_module(".prefill_attention", __package__)  # likewise

HQ, HKV, D, BLOCK = 12, 2, 128, 64
BATCHES, CONTEXTS = (1, 8, 32), (256, 1024, 4096)
SPLITS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CASES = ((1, 16), (1, 256), (1, 4096), (8, 2048), (32, 1024), (32, 4096))  # (groups, length)


def time_us(fn: Callable[[], object]) -> float:
    fn()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def copy_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_us(lambda: dst.copy_(src)) / 1e3  # read + write


def bench_case(batch: int, ctx: int, gen: torch.Generator) -> dict:
    n = ctx // BLOCK
    k_cache, v_cache = (torch.randn(batch * n, HKV, BLOCK, D, generator=gen).half().cuda() for _ in range(2))
    tables = torch.randperm(batch * n, generator=gen).view(batch, n).to(torch.int32).cuda()
    q = torch.randn(batch, HQ, D, generator=gen).half().cuda()
    full = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    mixed = torch.randint(1, ctx + 1, (batch,), generator=gen, dtype=torch.int32)
    mixed[0] = ctx  # one row at the full span: the padded mode walks it for every row
    mixed = mixed.cuda()
    out = torch.empty_like(q)
    scale = D ** -0.5

    def paged(lens: torch.Tensor, splits: int, pad_to_span: bool = False) -> float:
        ws = pa.paged_attention_workspace(batch, HQ, D, splits, "cuda")
        return time_us(lambda: pa.paged_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits,
                                                  pad_to_span=pad_to_span, out=out, workspace=ws))

    # Dense [B, Hkv, ctx, D] copies of each row's KV, in order.
    k_dense, v_dense = (c[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, HKV, ctx, D) for c in (k_cache, v_cache))
    q_grouped = q.view(batch, HKV, HQ // HKV, D)
    sdpa_out = torch.empty_like(q_grouped)

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_out.copy_(F.scaled_dot_product_attention(q_grouped, k_dense, v_dense, scale=scale))

    splits = pa.default_num_splits(batch, HKV, max_blocks=n)
    row = dict(batch=batch, ctx=ctx, splits=splits, paged=paged(full, splits), sdpa=time_us(sdpa))
    row["err"] = (out.float() - sdpa_out.view_as(out).float()).abs().max().item()
    row["best_us"], row["best_splits"] = min((paged(full, s), s) for s in SPLITS if s <= n)
    row["mixed_paged"] = paged(mixed, splits)
    row["mixed_padded"] = paged(mixed, splits, pad_to_span=True)
    row["gbps"] = batch * ctx * HKV * D * 2 * 2 / row["paged"] / 1e3  # K and V, fp16
    return row


ENGINE_TABLE_BLOCKS = 68  # the engine's block tables: (4096 + 256) tokens of 64
SWEEP_CASES = ((1, 1024), (8, 1024), (32, 256), (32, 1024), (32, 4096))


def sweep_decode() -> None:
    """Blocks per split, warps and stages of the decode kernel at the engine's block-table width, where most splits
    of a short row find no blocks; each case's best, what the engine runs, and the configurations best overall."""
    gen = torch.Generator().manual_seed(0)
    configs = [(c, w, st) for c in (1, 2, 4) for w in (4, 8) for st in (2, 3, 4)]
    shipped = pa.NUM_WARPS, pa.NUM_STAGES
    results = {}
    for batch, ctx in SWEEP_CASES:
        n = ctx // BLOCK
        k_cache, v_cache = (torch.randn(batch * n + 1, HKV, BLOCK, D, generator=gen).half().cuda() for _ in range(2))
        tables = torch.full((batch, ENGINE_TABLE_BLOCKS), batch * n, dtype=torch.int32)
        tables[:, :n] = torch.randperm(batch * n, generator=gen).view(batch, n)
        tables = tables.cuda()
        q = torch.randn(batch, HQ, D, generator=gen).half().cuda()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        for chunk, warps, stages in configs:
            splits = min(triton.cdiv(ENGINE_TABLE_BLOCKS, chunk), pa.MAX_SPLITS)
            ws = pa.paged_attention_workspace(batch, HQ, D, splits, "cuda")
            pa.NUM_WARPS, pa.NUM_STAGES = warps, stages
            results[batch, ctx, chunk, warps, stages] = time_us(lambda: pa.paged_attention(
                q, k_cache, v_cache, tables, lens, D ** -0.5, num_splits=splits, out=out, workspace=ws))
        pa.NUM_WARPS, pa.NUM_STAGES = shipped
        engine = (ENGINE_TABLE_BLOCKS // pa.default_num_splits(batch, HKV, max_blocks=ENGINE_TABLE_BLOCKS), *shipped)
        best = min((k for k in results if k[:2] == (batch, ctx)), key=results.get)
        print(f"{batch:>3} x {ctx:>4}: best (blocks a split, warps, stages) {best[2:]} {results[best]:.1f} us "
              f"({batch * ctx * HKV * D * 2 * 2 / results[best] / 1e3:.0f} GB/s); the engine's {engine} "
              f"{results[(batch, ctx, *engine)]:.1f} us", flush=True)
    totals = {c: sum(results[(b, x, *c)] for b, x in SWEEP_CASES) for c in configs}
    print("best over all cases (blocks a split, warps, stages): sum of the cases' us, then each case")
    for c in sorted(totals, key=totals.get)[:6]:
        print(f"  {c}: {totals[c]:.1f}  " + "  ".join(f"{results[(b, x, *c)]:.1f}" for b, x in SWEEP_CASES))


def decode_section(warps: int, stages: int) -> None:
    pa.NUM_WARPS, pa.NUM_STAGES = warps, stages  # the wrapper reads them per call: a tuning knob only
    peak = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {peak:.0f} GB/s; "
          f"paged kernel num_warps={pa.NUM_WARPS} num_stages={pa.NUM_STAGES}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(bench_case(batch, ctx, gen))
            print(".", end="", flush=True)
    print()
    print(f"{'B':>3} {'ctx':>5} {'splits':>6} {'paged us':>9} {'GB/s':>6} {'%copy':>6} {'SDPA us':>8} "
          f"{'t/SDPA':>7} {'best us(splits)':>16} {'mixed paged us':>15} {'padded us':>10} {'max|err|':>9}")
    for r in rows:
        print(f"{r['batch']:>3} {r['ctx']:>5} {r['splits']:>6} {r['paged']:>9.1f} {r['gbps']:>6.0f} "
              f"{100 * r['gbps'] / peak:>5.0f}% {r['sdpa']:>8.1f} {r['paged'] / r['sdpa']:>7.2f} "
              f"{r['best_us']:>9.1f} ({r['best_splits']:>2}) {r['mixed_paged']:>15.1f} {r['mixed_padded']:>10.1f} "
              f"{r['err']:>9.1e}")


def bench_prefill(groups: int, length: int, gen: torch.Generator) -> dict:
    tokens = groups * length
    q = torch.randn(tokens, HQ, D, generator=gen, device="cuda", dtype=torch.half)
    k, v = (torch.randn(tokens, HKV, D, generator=gen, device="cuda", dtype=torch.half) for _ in range(2))
    work = pfa.plan([length] * groups, pfa.default_block_m("cuda"))
    index = [torch.from_numpy(a).cuda() for a in (work.seq_start, work.seq_len, work.block_seq, work.block_q)]
    out = torch.empty_like(q)
    scale = D ** -0.5

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(groups, length, -1, D).transpose(1, 2)

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, scale=scale,
                                                  enable_gqa=True)

    row = dict(groups=groups, length=length,
               ours=time_us(lambda: pfa.prefill_attention(q, k, v, *index, scale, out=out)) / 1e3,
               flash=time_us(flash) / 1e3)
    row["err"] = (out.float() - flash().transpose(1, 2).reshape_as(out).float()).abs().max().item()
    flops = groups * 2 * length ** 2 * D * HQ  # causal: half of QK^T's and PV's 2 * L^2 * D FLOPs each, per head
    row["ours_tflops"], row["flash_tflops"] = (flops / (row[key] * 1e-3) / 1e12 for key in ("ours", "flash"))
    return row


def prefill_section() -> None:
    print(f"prefill kernel BLOCK_M={pfa.GPU_BLOCK_M} BLOCK_N={pfa.GPU_BLOCK_N} num_warps={pfa.GPU_NUM_WARPS} "
          f"num_stages={pfa.GPU_NUM_STAGES}")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for groups, length in PREFILL_CASES:
        rows.append(bench_prefill(groups, length, gen))
        print(".", end="", flush=True)
    print()
    print(f"{'groups':>6} {'len':>5} {'ours ms':>8} {'TFLOP/s':>8} {'flash ms':>9} {'TFLOP/s':>8} "
          f"{'ours/flash':>10} {'max|err|':>9}")
    for r in rows:
        print(f"{r['groups']:>6} {r['length']:>5} {r['ours']:>8.3f} {r['ours_tflops']:>8.0f} {r['flash']:>9.3f} "
              f"{r['flash_tflops']:>8.0f} {r['ours'] / r['flash']:>10.2f} {r['err']:>9.1e}")


@command("engine.kernels.bench")
def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("decode", "prefill"))
    parser.add_argument("--sweep", action="store_true", help="sweep the decode kernel's splits, warps and stages")
    parser.add_argument("--warps", type=int, default=pa.NUM_WARPS)
    parser.add_argument("--stages", type=int, default=pa.NUM_STAGES)
    args = parser.parse_args()
    if args.sweep:
        return sweep_decode()
    if args.only != "prefill":
        decode_section(args.warps, args.stages)
    if args.only != "decode":
        prefill_section()


if __name__ == "__main__":
    main()
