"""Where CPU time goes: GEMM throughput per backend, and a profile of one decode step.

    python scripts/profile_cpu.py gemm            # GFLOP/s of F.linear (MKL) vs oneDNN, plain and packed weight
    python scripts/profile_cpu.py step            # SmolLM2 fp32: one batch-32 decode step replayed, then profiled

`gemm` uses SmolLM2's shapes (hidden 576, qkv 960, gate_up 3072, down 1536 -> 576, LM head 49,152)
at decode (1-64 rows) and prefill (256-3,183 rows) sizes. `step` runs the offline benchmark's 32
prompts for 48 tokens, keeps the 30th decode batch and calls Engine.forward on it again (idempotent:
it rewrites the same KV slots), timing 40 replays and profiling 10 with torch.profiler. Each replay
is a steady decode step: the attention backend's dense KV copy is told it holds everything but the
batch's new tokens, so it appends them (`--rebuild`: every replay rebuilds the copy from the pool,
as the first step after the batch changed does).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out) features


def sorted_seconds(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Wall time of reps calls of fn after warmup calls, fastest first."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def gemm(rows: list[int]) -> None:
    print(f"{'rows':>5} {'in x out':>11}  {'F.linear':>9} {'oneDNN':>9} {'packed':>9}  GFLOP/s (best of reps)")
    for m in rows:
        for k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            reps = 100 if m <= 64 else 8
            figures = [
                2 * m * k * n / sorted_seconds(fn, reps)[0] / 1e9
                for fn in (
                    lambda: F.linear(x, w),
                    lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                )
            ]
            print(f"{m:>5} {k:>5}x{n:<5}  " + " ".join(f"{f:>9.1f}" for f in figures), flush=True)


def step(replays: int, rebuild: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from minisgl import LLM, SamplingParams
    from minisgl.bench.offline import make_prompts
    from minisgl.engine.engine import Engine

    decode_batches = []
    forward = Engine.forward

    def keep(self: Engine, batch: object) -> torch.Tensor:
        if batch.is_decode:  # type: ignore[attr-defined]
            decode_batches.append(batch)
        return forward(self, batch)

    llm = LLM("smollm2")
    Engine.forward = keep  # type: ignore[method-assign]
    try:
        llm.generate(make_prompts(49152, 32, 128, 0), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                     use_tqdm=False)
    finally:
        Engine.forward = forward  # type: ignore[method-assign]
    batch, engine = decode_batches[30], llm.scheduler.engine
    mirror = engine.attn_backend.mirror

    def replay() -> None:
        if not rebuild:  # the copy holds all but the new token of every request: this step appends
            mirror.rows, mirror.seq_lens = [r.table_idx for r in batch.reqs], [s - 1 for s in batch.seq_lens]
        engine.forward(batch)

    times = sorted_seconds(replay, replays, warmup=1)
    print(f"decode step, batch {batch.size}: best {times[0] * 1e3:.1f} ms, median {times[len(times) // 2] * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            replay()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["gemm", "step"])
    p.add_argument("--rows", default="1,32,64,256,3183", help="gemm: comma-separated row counts")
    p.add_argument("--replays", type=int, default=40, help="step: timed replays")
    p.add_argument("--rebuild", action="store_true", help="step: rebuild the dense KV copy on every replay")
    args = p.parse_args()
    if args.what == "gemm":
        gemm([int(r) for r in args.rows.split(",")])
    else:
        step(args.replays, args.rebuild)


if __name__ == "__main__":
    main()
