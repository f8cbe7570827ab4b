"""Full Qwen2.5-1.5B shapes in fp32 on CPU: the probe's old 'fp32 reference' (deepcopy(hf16).float(), inv_freq rounded
to fp16 by the old .to(float16)) against fp32 with Qwen2's exact inv_freq. Same weights (seeded on the CPU).
Run: TRITON_INTERPRET=1 PYTHONPATH=. python results/engine/parity-fp32/cpu_full_shapes_fp32.py 16,80,1024,2048,4096
(about 15 minutes on 2 cores; output in cpu_full_shapes_fp32.txt)"""
import sys, time, torch
from engine.weights import load_model
from traces.model_spec import QWEN25_1P5B
from traces.prompts import prompt_tokens, QWEN_TEXT_VOCAB
torch.set_num_threads(2)
lengths = [int(x) for x in sys.argv[1].split(",")]
m = load_model(None, QWEN25_1P5B, 0, torch.float16, "cpu")
hf = m.hf.float(); del m
re = hf.model.rotary_emb
exact = re.compute_default_rope_parameters(hf.config)[0]
rounded = exact.half().float()  # what the old load_model's .to(float16) left in the buffer
print("inv_freq max rel err", ((rounded - exact) / exact).abs().max().item(), flush=True)
vocab = QWEN25_1P5B["vocab_size"]
print("L | max|probe32 - exact32| | logit rms | top2 margin exact | argmax exact/probe | s", flush=True)
for n in lengths:
    ids = torch.tensor([prompt_tokens(n, min(vocab, QWEN_TEXT_VOCAB))])
    out = {}
    t0 = time.time()
    for name, f in (("probe", rounded), ("exact", exact)):
        re.inv_freq = f.clone(); re.original_inv_freq = f.clone()
        with torch.no_grad():
            out[name] = hf(ids, logits_to_keep=1).logits[0, -1].float()
    a, b = out["probe"], out["exact"]
    top = b.topk(2).values
    print(f"{n} | {(a-b).abs().max():.4f} | {b.pow(2).mean().sqrt():.3f} | {top[0]-top[1]:.4f} | {int(b.argmax())}/{int(a.argmax())} | {time.time()-t0:.0f}", flush=True)
