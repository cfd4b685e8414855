"""GPU time of a decode step's sampling on the Qwen3-0.6B vocabulary (151,936), replayed from CUDA graphs:

- `outside`: what the sampler runs after a graph replay (bf16 logits / float32 temperatures, then
  flashinfer.sampling.sampling_from_logits; greedy: argmax);
- `in-graph`: engine/gumbel.py's two kernels (Gumbel-max over the bf16 logits, then the per-row reduce).

    python3 tools/device/sampling_bench.py [--batches 256,128,64,8,1]   # after `source tools/device/env.sh`
"""

from __future__ import annotations

import argparse

import torch

VOCAB = 151936


def graph_us(fn, calls: int = 20, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * reps)


def main() -> None:
    import flashinfer.sampling

    from minisgl.engine import gumbel

    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="256,192,128,64,32,8,1")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bs in [int(b) for b in args.batches.split(",")]:
        logits = (torch.randn(bs, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        temps = torch.full((bs, 1), 0.6, device="cuda")
        ws = gumbel.Workspace(bs, VOCAB, "cuda")
        out = torch.empty(bs, dtype=torch.int64, device="cuda")
        zeros = torch.zeros(bs, device="cuda")
        rows = {
            "outside": graph_us(lambda: flashinfer.sampling.sampling_from_logits(logits / temps, generator=gen)),
            "in-graph": graph_us(lambda: gumbel.sample_into(logits, temps.view(-1), out, ws)),
            "outside greedy": graph_us(lambda: logits.argmax(dim=-1)),
            "in-graph greedy": graph_us(lambda: gumbel.sample_into(logits, zeros, out, ws)),
        }
        read = bs * VOCAB * 2 / 1e6
        print(
            f"bs {bs:4d} ({read:5.1f} MB of bf16 logits): " + ", ".join(f"{k} {v:6.1f} us" for k, v in rows.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
