"""Engine speed on the GPU, measured side by side in one run (issue: decode near the memory floor).

    python -m engine.bench [--out results/bench] [--expect-gpu "NVIDIA H200"] [--quick]

Prints, for uniform decode batches (rows 1, 8, 32 x context 256, 1024, 4096): the engine's decode step
time from its own step log (`paged`, `padded`) and the GPU time of one graph replay, tokens/s, the
bandwidth floor (weight + K/V bytes over the device-to-device copy bandwidth measured here) and the
ratio to it, and HF transformers' eager `generate` on the same weights; prefill tokens/s by group width
and padded length; the closed mixed 32-row run and 64 requests through 8 rows. Writes bench.json and
bench.md to --out with the device and versions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from traces.metrics import closed_run
from traces.provenance import provenance
from traces.workload import closed_mixed, length_trace

from .engine import Engine, EngineConfig, device_info

ROWS, CONTEXTS = (1, 8, 32), (256, 1024, 4096)
DECODE_BUDGET = 64


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench", help="directory for bench.json and bench.md")
    ap.add_argument("--expect-gpu", metavar="NAME")
    ap.add_argument("--quick", action="store_true", help="rows 8,32 x context 1024 only; no HF baseline")
    args = ap.parse_args(argv)
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
            hf = None if args.quick else hf_decode(engine, rows, ctx)
            for b, p in pts.items():
                p.update(floor_ms=1e3 * floor, vs_floor=p["step_ms"] / (1e3 * floor),
                         hf_step_ms=None if hf is None else 1e3 * hf,
                         vs_hf=None if hf is None else hf / (p["step_ms"] / 1e3))
                decode.append(p)
            print(f"rows {rows:2d} ctx {ctx:4d}: paged {pts['paged']['step_ms']:.3f} ms, padded {pts['padded']['step_ms']:.3f} ms, "
                  f"floor {1e3 * floor:.3f} ms" + ("" if hf is None else f", HF eager {1e3 * hf:.2f} ms"))
    prefill = []
    for width in ((8, 32) if args.quick else (1, 8, 32)):
        for n in ((1024,) if args.quick else (256, 1024, 4096)):
            times = []
            for _ in range(4):
                rec = engine.run(length_trace([(0.0, n, 1)] * width), None, "paged", tokens=False, max_batch=width,
                                 progress=False)
                p = rec.steps[rec.steps.kind == "prefill"]
                times.append(float((p.end - p.start).iloc[0]))
            t = statistics.median(times[1:])
            prefill.append({"width": width, "padded_len": n, "ms": 1e3 * t, "tok_s": width * n / t})
    closed = [closed_point(engine, closed_mixed(32, 0), 32), closed_point(engine, closed_mixed(64, 0), 8)]
    uniform32 = next((p["tok_s"] for p in decode if p["backend"] == "paged" and p["rows"] == 32
                      and p["ctx"] == 1024), None)
    report = {"device": device_info(engine.device), "copy_bandwidth_Bps": bw, "weight_bytes": weight_bytes,
              "decode": decode, "prefill": prefill, "closed": closed, **provenance(),
              "targets": _targets(decode, closed, uniform32)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = _markdown(report)
    (out / "bench.md").write_text(md)
    print(md)
    return 0


def _targets(decode: list[dict], closed: list[dict], uniform32: float | None) -> dict:
    by = {(p["backend"], p["rows"], p["ctx"]): p for p in decode}
    ratios = [by["paged", r, c]["step_ms"] / by["padded", r, c]["step_ms"] for (b, r, c) in by if b == "paged" and r >= 8]
    floor = by.get(("paged", 32, 1024))
    hf = [p["vs_hf"] for p in decode if p["backend"] == "paged" and p["rows"] == 32 and p["vs_hf"]]
    return {"paged_over_padded_max_uniform_8_32": max(ratios) if ratios else None,
            "step_over_floor_32x1024": floor["vs_floor"] if floor else None,
            "speedup_over_hf_32_rows_min": min(hf) if hf else None,
            "closed_mixed32_decode_over_uniform32": closed[0]["decode_tok_s"] / uniform32 if uniform32 else None}


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
    lines += ["", "## Prefill (one admission group, engine step)", "", "| width | padded len | ms | tok/s |", "|---|---|---|---|"]
    lines += [f"| {p['width']} | {p['padded_len']} | {p['ms']:.1f} | {p['tok_s']:.0f} |" for p in r["prefill"]]
    lines += ["", "## Closed runs (median of 3 after 1 warm-up)", "", "| requests | max batch | wall s | decode tok/s | TTFT p50 s |",
              "|---|---|---|---|---|"]
    lines += [f"| {c['requests']} | {c['max_batch']} | {c['wall_s']:.3f} | {c['decode_tok_s']:.0f} | {c['ttft_p50_s']:.3f} |"
              for c in r["closed"]]
    lines += ["", "## Targets", ""] + [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}"
                                       for k, v in r["targets"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
