"""The engine in fp16 (the GPU's 128x64 tiles, under the interpreter) on a 2-layer model with the real RoPE (head_dim
128, rope_theta 1e6) against HF fp32 with the old rounded inv_freq (probe32) and with the exact one (true32).
Run: TRITON_INTERPRET=1 PYTHONPATH=. python results/engine/parity-fp32/cpu_small_model_fp16.py 16,256,1024,2048
(about 10 minutes; output, taken before the fix, in cpu_small_model_fp16.txt)"""
import sys, copy, time, torch
from engine.kernels import prefill_attention as pa
pa.INTERPRET_BLOCK_M, pa.INTERPRET_BLOCK_N = 128, 64  # the GPU's tiles, and fewer interpreted programs
from engine.weights import load_model
from engine.qwen2 import PagedQwen2
from traces.model_spec import QWEN25_1P5B
from traces.prompts import prompt_tokens, QWEN_TEXT_VOCAB
torch.set_num_threads(2)
spec = dict(QWEN25_1P5B, name="probe", hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, intermediate_size=512, vocab_size=2048, tie_word_embeddings=True)
lengths = [int(x) for x in sys.argv[1].split(",")]
m = load_model(None, spec, 0, torch.float16, "cpu")
hf = m.hf
eng = PagedQwen2(m, max(lengths))
exact = 1.0 / (spec["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
def fixed(model):
    model = copy.deepcopy(model)
    re = model.model.rotary_emb
    re.inv_freq = exact.clone(); re.original_inv_freq = exact.clone()
    return model
def rounded(model):  # the old load_model's .to(float16) rounded inv_freq; .float() kept the rounding
    model = copy.deepcopy(model)
    re = model.model.rotary_emb
    re.inv_freq = exact.half().float(); re.original_inv_freq = exact.half().float()
    return model
hf = rounded(hf)                                  # HF fp16 as the old probe ran it
hf32_as_probe = copy.deepcopy(hf).float()       # what scripts/parity_fp32_probe.py called fp32
hf32_true = fixed(hf).float()                    # fp32 with Qwen2's real RoPE frequencies
hf16_fixed = fixed(hf)
print("L | eng-probe32 | hf16-probe32 | eng-true32 | hf16-true32 | hf16fixed-true32 | probe32-true32 | eng_s")
for n in lengths:
    ids = torch.tensor([prompt_tokens(n, min(spec["vocab_size"], QWEN_TEXT_VOCAB))])
    with torch.no_grad():
        p32 = hf32_as_probe(ids).logits[0, -1].float()
        t32 = hf32_true(ids).logits[0, -1].float()
        h16 = hf(ids).logits[0, -1].float()
        h16f = hf16_fixed(ids).logits[0, -1].float()
        t0 = time.time(); e = eng.dense_logits(ids)[0].float(); dt = time.time() - t0
    f = lambda a, b: f"{(a - b).abs().max().item():.4f}"
    print(f"{n} | {f(e,p32)} | {f(h16,p32)} | {f(e,t32)} | {f(h16,t32)} | {f(h16f,t32)} | {f(p32,t32)} | {dt:.0f}", flush=True)
