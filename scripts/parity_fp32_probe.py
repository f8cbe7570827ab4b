"""Which side of a parity flip is off: the engine's and HF's first-token logits in the model's dtype, each against
HF's in float32 (the same weights upcast), for the gate's prompt lengths. A flip where the engine is closer to the
float32 reference than HF's own fp16 run is the reference's rounding, not an engine error.
Both HF models must carry RoPE's exact float32 inv_freq (servecap/engine/weights.py cast_weights); the probe says so first.
Usage (GPU): python scripts/parity_fp32_probe.py [--lengths 16,1024,4096] [--device cuda|cpu --model tiny]
[--dtype float16] (default: float16 on cuda, float32 on cpu)"""
from __future__ import annotations

import copy
import sys

import torch

from servecap.core.config import ServingConfig
from servecap.engine.engine import Engine, EngineConfig
from servecap.traces.command import Parser, command
from servecap.traces.model_spec import DEFAULT_MODEL
from servecap.traces.prompts import QWEN_TEXT_VOCAB, prompt_tokens


@command("parity_fp32_probe")
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="16,80,1024,2048,4096")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    engine = Engine(EngineConfig(ServingConfig(model=args.model, dtype=dtype, max_batch=1),
                                 max_prompt=max(lengths), max_budget=4, device=args.device))
    hf = engine.loaded.hf
    hf32 = copy.deepcopy(hf).float()
    vocab = engine.loaded.spec["vocab_size"]
    for name, model in (("HF", hf), ("HF fp32", hf32)):
        rotary = model.model.rotary_emb
        exact = torch.equal(rotary.inv_freq, rotary.compute_default_rope_parameters(model.config)[0].to(hf.device))
        print(f"{name}: weights {next(model.parameters()).dtype}, RoPE inv_freq {rotary.inv_freq.dtype}, "
              f"Qwen2's exact frequencies: {exact}")
    print("length | max |engine-fp32| | max |HF-fp32| | max |engine-HF| | top-2 margin fp32 | argmax fp32 / engine / HF")
    for n in lengths:
        ids = torch.tensor([prompt_tokens(n, min(vocab, QWEN_TEXT_VOCAB))], device=hf.device)
        with torch.no_grad():
            ref = hf32(ids).logits[0, -1].float()
            ref16 = hf(ids).logits[0, -1].float()
            eng = engine.model.dense_logits(ids, engine.cfg.serving.block_size)[0].float()
        top = ref.topk(2).values
        print(f"{n:6d} | {(eng - ref).abs().max():.4f} | {(ref16 - ref).abs().max():.4f} | "
              f"{(eng - ref16).abs().max():.4f} | {top[0] - top[1]:.4f} | "
              f"{int(ref.argmax())} / {int(eng.argmax())} / {int(ref16.argmax())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
