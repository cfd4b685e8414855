"""Patched HF generate on the GPU, do_sample=True: seeded from torch's global RNG (the drop-in now) against unseeded
(the drop-in before session 17); timings and whether set_seed reproduces the sample.

    python3 tools/device/hf_sample_probe.py <dummy model dir>   # after `source tools/device/env.sh`
"""
import sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM, set_seed
import transformers_minisgl.generate as g
from transformers_minisgl import patch_generate

md = sys.argv[1]
config = AutoConfig.from_pretrained(md)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
patch_generate(model)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, 10000, (64, 256), generator=gen).cuda()
mask = torch.ones_like(ids)
seeds = g._seeds
def run():
    torch.cuda.synchronize(); t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=0,
                         max_new_tokens=128, min_new_tokens=128)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out
for rep in range(3):
    for name, fn in (("seeded (now)", seeds), ("unseeded (before)", lambda p, k, n: [None] * k)):
        g._seeds = fn
        set_seed(5); s1, a = run()
        set_seed(5); s2, b = run()
        print(f"{name:18s} {s1:.3f} s / {s2:.3f} s, 64 x 128 tokens; same sample after set_seed: {torch.equal(a, b)}", flush=True)
