"""Engine speed on the GPU, measured side by side in one run.

    python -m engine.bench [--out results/bench] [--expect-gpu "NVIDIA H200"] [--quick] [--hf] [--profile]

Prints, for uniform decode batches (rows 1, 8, 32 x context 256, 1024, 4096): the engine's decode step
time from its own step log (`paged`, `padded`) and the GPU time of one graph replay, tokens/s, the
bandwidth floor (weight + K/V bytes over the device-to-device copy bandwidth measured here) and the
ratio to it, and with --hf HF transformers' eager `generate` on the same weights; prefill steps by group
width and padded length, each as the engine runs it (a graph replay up to its graph bucket) and the same
step's forward pass run eagerly, side by side; the closed mixed 32-row run and 64 requests through 8 rows;
with --profile, the GPU time of each kernel of one 32 x 1024 decode step. Writes bench.json and bench.md to
--out with the device and versions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from servecap.traces.command import Parser, command
from servecap.traces.metrics import closed_run
from servecap.traces.outpath import check_out_dir
from servecap.traces.provenance import provenance
from servecap.traces.workload import closed_mixed, length_trace

from .engine import Engine, EngineConfig, device_info

ROWS, CONTEXTS = (1, 8, 32), (256, 1024, 4096)
DECODE_BUDGET = 64
PREFILL = ((1, 16), (1, 256), (1, 1024), (1, 4096), (8, 256), (8, 2048), (32, 1024), (32, 4096))
# Targets: a 1 x 16 and a 1 x 256 prefill within about two decode steps; large groups at least as fast as before.
PREFILL_TARGETS = {(1, 16): ("ms", 3.0), (1, 256): ("ms", 4.0), (8, 2048): ("tok_s", 200_000)}


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def graph_time(engine: Engine, backend: str, rows: int, reps: int = 50) -> float:
    """GPU time of one decode graph replay (inputs left from the run that just finished)."""
    g = engine.runner.graphs[backend, rows]
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def hf_decode(engine: Engine, rows: int, ctx: int, steps: int = 32) -> float:
    """HF eager generate's decode seconds per step: (generate n+steps tokens - generate 1) / steps."""
    hf = engine.loaded.hf
    hf.generation_config.eos_token_id = None
    ids = torch.randint(0, 1000, (rows, ctx), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)
    return (statistics.median(gen(steps + 1) for _ in range(2)) - statistics.median(gen(1) for _ in range(2))) / steps


def decode_point(engine: Engine, backend: str, rows: int, ctx: int) -> dict:
    rec = engine.run(length_trace([(0.0, ctx, DECODE_BUDGET)] * rows), None, backend, tokens=False,
                     max_batch=rows, progress=False)
    d = rec.steps[(rec.steps.kind == "decode") & (rec.steps.retired == 0)]
    step = float((d.end - d.start).median())
    return {"backend": backend, "rows": rows, "ctx": ctx, "step_ms": 1e3 * step, "gpu_ms": 1e3 * graph_time(engine, backend, rows),
            "tok_s": rows / step, "kv_read": int(d.kv_read.median())}


def prefill_point(engine: Engine, width: int, n: int, reps: int = 5) -> dict:
    """A padded group's prefill step from the engine's step log (median of reps after one warm-up), and the same
    step's forward pass run eagerly (no graph) on the inputs the engine left, timed by device events."""
    times = []
    for _ in range(reps + 1):
        rec = engine.run(length_trace([(0.0, n, 1)] * width), None, "paged", tokens=False, max_batch=width,
                         progress=False)
        p = rec.steps[rec.steps.kind == "prefill"]
        times.append(float((p.end - p.start).iloc[0]))
    step = statistics.median(times[1:])
    r = engine.runner
    bucket = r.bucket(width * n)
    eager = None
    if bucket in r.prefill_graphs:
        def forward():
            r._prefill_forward(bucket)
        eager = _device_time(forward)
    return {"width": width, "padded_len": n, "bucket": bucket, "graph": bucket in r.prefill_graphs,
            "ms": 1e3 * step, "tok_s": width * n / step, "eager_ms": None if eager is None else 1e3 * eager}


def _device_time(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def closed_point(engine: Engine, trace, max_batch: int, backend: str = "paged", warmup: int = 1, repeat: int = 3) -> dict:
    runs = []
    for i in range(warmup + repeat):
        rec = engine.run(trace, None, backend, tokens=False, max_batch=max_batch, progress=False)
        if i >= warmup:
            runs.append(closed_run(rec))
    return {"requests": len(trace), "max_batch": max_batch, "backend": backend,
            "wall_s": statistics.median(r["wall_time_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "ttft_p50_s": statistics.median(r["ttft_p50"] for r in runs)}


@command("engine.bench")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m engine.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench", help="directory for bench.json and bench.md")
    ap.add_argument("--expect-gpu", metavar="NAME")
    ap.add_argument("--quick", action="store_true", help="rows 8,32 x context 1024 only")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers' eager generate (slow)")
    ap.add_argument("--profile", action="store_true", help="also list the kernels of one 32 x 1024 decode step")
    args = ap.parse_args(argv)
    check_out_dir(args.out)  # before minutes of measuring
    engine = Engine(EngineConfig(expect_gpu=args.expect_gpu))
    m = engine.model
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       [m.embed, m.norm] + [x for L in m.layers for x in vars(L).values()]
                       + ([] if m.lm_head.data_ptr() == m.embed.data_ptr() else [m.lm_head]))
    bw = copy_bandwidth()
    print(f"{device_info(engine.device)['name']}: copy bandwidth {bw / 1e12:.2f} TB/s, weights {weight_bytes / 1e9:.3f} GB")
    rows_set, ctxs = ((8, 32), (1024,)) if args.quick else (ROWS, CONTEXTS)
    decode = []
    for rows in rows_set:
        for ctx in ctxs:
            pts = {b: decode_point(engine, b, rows, ctx) for b in engine.cfg.backends}
            floor = (weight_bytes + pts["paged"]["kv_read"] * engine.kv_bytes_per_token) / bw
            hf = hf_decode(engine, rows, ctx) if args.hf else None
            for b, p in pts.items():
                p.update(floor_ms=1e3 * floor, vs_floor=p["step_ms"] / (1e3 * floor),
                         hf_step_ms=None if hf is None else 1e3 * hf,
                         vs_hf=None if hf is None else hf / (p["step_ms"] / 1e3))
                decode.append(p)
            print(f"rows {rows:2d} ctx {ctx:4d}: paged {pts['paged']['step_ms']:.3f} ms, padded {pts['padded']['step_ms']:.3f} ms, "
                  f"floor {1e3 * floor:.3f} ms" + ("" if hf is None else f", HF eager {1e3 * hf:.2f} ms"))
    prefill = [prefill_point(engine, w, n) for w, n in (PREFILL[:2] + PREFILL[5:6] if args.quick else PREFILL)]
    for p in prefill:
        print(f"prefill {p['width']:2d} x {p['padded_len']:4d}: {p['ms']:.2f} ms ({p['tok_s']:,.0f} tok/s)"
              + (f", eager forward {p['eager_ms']:.2f} ms" if p["eager_ms"] else ""))
    closed = [closed_point(engine, closed_mixed(32, 0), 32), closed_point(engine, closed_mixed(64, 0), 8)]
    kernels = profile_decode(engine, 32, 1024) if args.profile else None
    uniform32 = next((p["tok_s"] for p in decode if p["backend"] == "paged" and p["rows"] == 32
                      and p["ctx"] == 1024), None)
    report = {"device": device_info(engine.device), "copy_bandwidth_Bps": bw, "weight_bytes": weight_bytes,
              "decode": decode, "prefill": prefill, "closed": closed, "decode_kernels": kernels,
              "engine": engine.metadata()["engine"],
              **provenance(), "targets": _targets(decode, prefill, closed, uniform32)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = _markdown(report)
    (out / "bench.md").write_text(md)
    print(md)
    return 0


def profile_decode(engine: Engine, rows: int, ctx: int, reps: int = 20) -> list[dict]:
    """GPU time per kernel in one decode step (graph replays under torch's profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    decode_point(engine, "paged", rows, ctx)  # leaves the graph's inputs at this shape
    g = engine.runner.graphs["paged", rows]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            agg.setdefault(e.name, []).append(e.device_time_total)
    out = sorted(({"kernel": k[:90], "calls_per_step": len(v) / reps, "us_per_step": sum(v) / reps}
                  for k, v in agg.items()), key=lambda r: -r["us_per_step"])
    print(f"decode {rows} x {ctx}: {sum(r['calls_per_step'] for r in out):.0f} kernels, "
          f"{sum(r['us_per_step'] for r in out):.0f} us of kernel time")
    for r in out[:25]:
        print(f"  {r['us_per_step']:8.1f} us  {r['calls_per_step']:5.0f} x  {r['kernel']}")
    return out


def _targets(decode: list[dict], prefill: list[dict], closed: list[dict], uniform32: float | None) -> dict:
    pre = {(p["width"], p["padded_len"]): p for p in prefill}
    by = {(p["backend"], p["rows"], p["ctx"]): p for p in decode}
    ratios = [by["paged", r, c]["step_ms"] / by["dense", r, c]["step_ms"] for (b, r, c) in by if b == "paged" and r >= 8]
    floor = by.get(("paged", 32, 1024))
    hf = [p["vs_hf"] for p in decode if p["backend"] == "paged" and p["rows"] == 32 and p["vs_hf"]]
    return {"paged_over_padded_max_uniform_8_32": max(ratios) if ratios else None,
            "step_over_floor_32x1024": floor["vs_floor"] if floor else None,
            "speedup_over_hf_32_rows_min": min(hf) if hf else None,
            "closed_mixed32_decode_over_uniform32": closed[0]["decode_tok_s"] / uniform32 if uniform32 else None,
            **{f"prefill_{w}x{n}_{unit}": pre[w, n][unit] for (w, n), (unit, _) in PREFILL_TARGETS.items() if (w, n) in pre},
            **{f"prefill_{w}x{n}_{unit}_target": t for (w, n), (unit, t) in PREFILL_TARGETS.items() if (w, n) in pre}}


def _prefill_row(p: dict) -> str:
    eager = "| |" if p["eager_ms"] is None else f"| {p['eager_ms']:.2f} | {p['ms'] / p['eager_ms']:.2f} |"
    return (f"| {p['width']} | {p['padded_len']} | {p['bucket']} | {'yes' if p['graph'] else 'no'} | {p['ms']:.2f} | "
            f"{p['tok_s']:.0f} {eager}")


def _markdown(r: dict) -> str:
    d = r["device"]
    lines = [f"# Engine benchmark: {d['name']}", "",
             f"torch {r['software']['torch']}, triton {r['software']['triton']}, transformers {r['software']['transformers']}, "
             f"CUDA {d['cuda']}; copy bandwidth {r['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; weights "
             f"{r['weight_bytes'] / 1e9:.2f} GB; {r['created_at']}", "",
             "## Decode, uniform batches (step = engine step from its step log; gpu = one graph replay)", "",
             "| backend | rows | ctx | step ms | gpu ms | tok/s | floor ms | step/floor | HF eager ms | speedup vs HF |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["decode"]:
        hf = "" if p["hf_step_ms"] is None else f"{p['hf_step_ms']:.2f}"
        vs = "" if p["vs_hf"] is None else f"{p['vs_hf']:.1f}x"
        lines.append(f"| {p['backend']} | {p['rows']} | {p['ctx']} | {p['step_ms']:.3f} | {p['gpu_ms']:.3f} | "
                     f"{p['tok_s']:.0f} | {p['floor_ms']:.3f} | {p['vs_floor']:.2f} | {hf} | {vs} |")
    lines += ["", "## Prefill (one padded admission group: the engine's step; the same forward pass run eagerly)", "",
              "| width | padded len | bucket | graph | step ms | tok/s | eager forward ms | step / eager |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [_prefill_row(p) for p in r["prefill"]]
    lines += ["", "## Closed runs (median of 3 after 1 warm-up)", "", "| requests | max batch | wall s | decode tok/s | TTFT p50 s |",
              "|---|---|---|---|---|"]
    lines += [f"| {c['requests']} | {c['max_batch']} | {c['wall_s']:.3f} | {c['decode_tok_s']:.0f} | {c['ttft_p50_s']:.3f} |"
              for c in r["closed"]]
    if r.get("decode_kernels"):
        k = r["decode_kernels"]
        lines += ["", f"## Kernels of one 32 x 1024 decode step (graph replays under torch's profiler): "
                      f"{sum(x['calls_per_step'] for x in k):.0f} launches, {sum(x['us_per_step'] for x in k):.0f} us", "",
                  "| us per step | launches | kernel |", "|---|---|---|"]
        lines += [f"| {x['us_per_step']:.1f} | {x['calls_per_step']:.0f} | `{x['kernel']}` |" for x in k]
    lines += ["", "## Targets", ""] + [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}"
                                       for k, v in r["targets"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
