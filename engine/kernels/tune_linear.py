"""Measure the decode matrix products on this GPU and keep, per weight shape and row tile, the faster of cuBLAS and
the split-K kernel's candidate configurations:

    python -m engine.kernels.tune_linear [--out engine/kernels/linear_configs.json] [--quick]

Shapes are the model's (QKV with its bias, attention output, gate/up, down with SiLU(gate) * up fused into its
input, the LM head). Each candidate is checked against torch's product on the same inputs, then timed as a CUDA
graph of one product per layer, each on its own weight copy, so the weights come from memory as in a decode step
(triton's do_bench, median). Writes the chosen configurations under this GPU's name, with every timing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from traces.errors import InputError
from traces.model_spec import QWEN25_1P5B
from traces.provenance import provenance

from .activation import silu_mul
from .linear import CONFIGS, Config, block_m, config_key, linear_triton

ROWS = (16, 32)  # the two row tiles: 1-16 rows run the 16-row tile, 17-32 the 32-row one
MAX_ERR = 2e-2  # relative Frobenius error against torch's fp16 product: fp16 rounding of sums of ~1e3-1e4 terms


def shapes(spec: dict) -> list[tuple[str, int, int, bool, bool]]:
    """(name, N, K, bias, silu_mul) of each product in a layer and the LM head."""
    h, d = spec["hidden_size"], spec["head_dim"]
    qkv = (spec["num_attention_heads"] + 2 * spec["num_key_value_heads"]) * d
    i = spec["intermediate_size"]
    return [("qkv", qkv, h, True, False), ("o", h, spec["num_attention_heads"] * d, False, False),
            ("gate_up", 2 * i, h, False, False), ("down", h, i, False, True), ("lm_head", spec["vocab_size"], h, False, False)]


def candidates(n: int, k: int, quick: bool) -> list[Config]:
    """Tiles that give the GPU's 132 multiprocessors a few programs each, with at least one K block per split."""
    out = []
    for bn in (16, 32, 64, 128):
        for split in (1, 2, 4, 8, 16):
            programs = triton.cdiv(n, bn) * split
            if not 256 <= programs <= 2048 and not (split == 1 and programs > 2048):
                continue
            for bk in (64, 128, 256):
                if k // split < bk or (split == 1 and bk == 64):
                    continue
                out.append(Config(bn, bk, split, 4, 4))
    if quick:
        out = out[::3]
    return out


def time_us(fn, reps: int) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / reps


def measure(name: str, n: int, k: int, has_bias: bool, silu: bool, rows: int, copies: int, quick: bool) -> dict:
    gen = torch.Generator("cuda").manual_seed(0)
    ws = [torch.randn(n, k, generator=gen, device="cuda").mul_(k ** -0.5).half() for _ in range(copies)]
    bias = torch.randn(n, generator=gen, device="cuda").half() if has_bias else None
    a = torch.randn(rows, 2 * k if silu else k, generator=gen, device="cuda").half()
    ref = F.linear(silu_mul(a) if silu else a, ws[0], bias).float()

    def cublas(i: int = 0) -> torch.Tensor:
        return F.linear(silu_mul(a) if silu else a, ws[i], bias)

    timings = {"cublas": time_us(cublas, copies)}
    for cfg in candidates(n, k, quick):
        out = linear_triton(a, ws[0], bias, cfg, silu_mul=silu).float()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < MAX_ERR:
            raise RuntimeError(f"{name} {cfg}: relative error {err:.2e} against torch")
        timings[json.dumps(list(cfg))] = time_us(lambda i=0: linear_triton(a, ws[i], bias, cfg, silu_mul=silu), copies)
    best = min(timings, key=timings.get)
    return {"key": config_key(n, k, block_m(rows), silu), "shape": name, "rows": rows, "timings_us": timings,
            "cublas_us": timings["cublas"], "best": best, "best_us": timings[best],
            "gbps": n * k * 2 / timings[best] / 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CONFIGS, help="configuration file to add this GPU to")
    parser.add_argument("--quick", action="store_true", help="a third of the candidates")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: tuning the decode products needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    spec = QWEN25_1P5B
    results = []
    for shape, n, k, has_bias, silu in shapes(spec):
        copies = max(2, min(spec["num_hidden_layers"], (1 << 30) // (n * k * 2)))
        for rows in ROWS:
            r = measure(shape, n, k, has_bias, silu, rows, copies, args.quick)
            results.append(r)
            print(f"{shape:>8} {n:>6}x{k:<5} rows {rows:>2}: cuBLAS {r['cublas_us']:7.2f} us, best {r['best']:<22} "
                  f"{r['best_us']:7.2f} us ({r['cublas_us'] / r['best_us']:.2f}x, {r['gbps']:.0f} GB/s)", flush=True)
    try:
        doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    except json.JSONDecodeError as e:
        raise InputError(f"not a JSON configuration file: {e}", path=args.out) from None
    doc.setdefault("devices", {})[name] = {r["key"]: None if r["best"] == "cublas" else json.loads(r["best"])
                                           for r in results}
    doc.setdefault("measured", {})[name] = {"provenance": provenance(), "results": results}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    total_c = sum(r["cublas_us"] for r in results if r["rows"] == 32)
    total_b = sum(r["best_us"] for r in results if r["rows"] == 32)
    print(f"wrote {args.out}; one product of each shape at 32 rows: cuBLAS {total_c:.1f} us, chosen {total_b:.1f} us")


if __name__ == "__main__":
    main()
