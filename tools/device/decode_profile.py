"""Where a decode step's GPU time goes: the kernels of small-batch decode steps by total time, bf16 and FP8.

    python3 tools/device/decode_profile.py [--shape qwen3-8b] [--quantization fp8] [--batch 1] [--tokens 64]

Builds the dummy-weight model of `minisgl bench throughput --shape` (tokenizer files from MINISGL_TOKENIZER_DIR),
generates once to warm up, then generates `--tokens` tokens for `--batch` requests of 128-token prompts under
torch.profiler (CUDA graph replays included: CUPTI records each kernel of a replayed graph). Prints each kernel's
total microseconds per decode step and launches per step, the sum, and the wall time per step.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from minisgl import LLM, SamplingParams, env
from minisgl.bench.throughput import write_model_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    model_dir = write_model_dir(Path(env.TOKENIZER_DIR.get() or "tok"), args.shape)
    llm = LLM(str(model_dir), dtype="bfloat16", load_format="dummy", quantization=args.quantization)
    rng = random.Random(1)
    prompts = [[rng.randint(0, 10000) for _ in range(128)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name][0] += e.device_time
            totals[e.name][1] += 1
    steps = args.tokens
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    label = f"{args.shape}, {args.quantization or 'bf16'}, batch {args.batch}, {steps} steps"
    print(f"{label}: wall {wall / steps * 1e3:.3f} ms/step (prefill included)")
    print(f"{'us/step':>9s} {'n/step':>7s}  kernel")
    for name, (us, n) in rows[: args.top]:
        print(f"{us / steps:9.1f} {n / steps:7.1f}  {name[:110]}")
    total = sum(us for us, _ in totals.values())
    print(f"{total / steps:9.1f} {sum(n for _, n in totals.values()) / steps:7.1f}  all kernels")
    llm.shutdown()


if __name__ == "__main__":
    main()
