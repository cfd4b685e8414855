"""Where a decode step's time goes, on the issue-8 workload (Qwen3-0.6B-shaped dummy model).

    python scripts/gpu_profile.py [--disable-overlap] [--disable-cuda-graph]

Runs the 256-request workload step by step and reports, over the steady decode phase: wall time
per step, the time the host waits for the GPU (event syncs), the GPU kernels by total time
(torch.profiler), and the host's Python hot spots (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import workload, write_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-dir", default=".carry/tok")
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    args = p.parse_args()

    from minisgl import LLM, SamplingParams

    llm = LLM(str(write_model_dir(Path(args.tokenizer_dir))), dtype="bfloat16", load_format="dummy",
              max_prefill_tokens=args.max_prefill_tokens, disable_overlap=args.disable_overlap,
              disable_cuda_graph=args.disable_cuda_graph)
    sched = llm.scheduler
    prompts, max_tokens = workload()
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        sched.add_request(f"r{i}", prompt, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))

    waited = [0.0]
    sync = torch.cuda.Event.synchronize

    def timed_sync(self: torch.cuda.Event) -> None:
        t0 = time.perf_counter()
        sync(self)
        waited[0] += time.perf_counter() - t0

    torch.cuda.Event.synchronize = timed_sync  # type: ignore[method-assign]
    walls, waits, sizes = [], [], []
    step = 0
    t_start = time.perf_counter()
    while sched.has_work:
        step += 1
        if step == 150:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if step == 170:
            prof.__exit__(None, None, None)
            cpu = cProfile.Profile()
            cpu.enable()
        if step == 190:
            cpu.disable()
        waited[0] = 0.0
        t0 = time.perf_counter()
        sched.step()
        walls.append(time.perf_counter() - t0)
        waits.append(waited[0])
        sizes.append(len(sched.running))
    total = time.perf_counter() - t_start
    torch.cuda.Event.synchronize = sync  # type: ignore[method-assign]

    print(f"\n{step} steps in {total:.2f}s")
    for lo, hi in ((20, 120), (120, 150), (400, 500), (800, 900)):
        w, s = walls[lo:hi], waits[lo:hi]
        if w:
            print(f"steps {lo}-{hi}: running ~{sizes[lo]:3d}, wall {1000 * sum(w) / len(w):6.2f} ms/step, "
                  f"waiting for the GPU {1000 * sum(s) / len(s):6.2f} ms/step")
    print("\nGPU kernels over 20 decode steps (bs ~256):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    out = io.StringIO()
    pstats.Stats(cpu, stream=out).sort_stats("tottime").print_stats(22)
    print("\nhost hot spots over 20 steps (cProfile, tottime):")
    print("\n".join(out.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
