"""Decode-sized GEMMs: cuBLAS (torch.mm) against each of the algorithms cuBLASLt's heuristic offers for the shape.

For each weight shape and row count, every candidate cuBLASLt returns (nvmath-python's planner, up to --limit) is
timed in a CUDA graph over distinct weights (none in L2, as in a decode step) and compared with torch.mm's; the
best three are listed with their tiles, split-K and largest difference from torch.mm's output. Needs nvmath-python
(`pip install nvmath-python`; not a minisgl dependency).

    python3 tools/device/cublaslt_candidates_bench.py [--rows 16,64,128,256] [--limit 24]   # after env.sh
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import graph_us

SHAPES = {  # name: (out features, in features, distinct weights in the graph)
    "0.6B qkv": (4096, 1024, 28),
    "0.6B o": (1024, 2048, 28),
    "0.6B gate_up": (6144, 1024, 28),
    "0.6B down": (1024, 3072, 28),
    "0.6B lm_head": (151936, 1024, 2),
    "30B-A3B qkv": (5120, 2048, 24),
    "30B-A3B o": (2048, 4096, 24),
    "30B-A3B lm_head": (151936, 2048, 2),
}


def candidates(x: torch.Tensor, weights: list[torch.Tensor], limit: int) -> list[tuple]:
    """(µs, algorithm, max diff) of each cuBLASLt candidate for x @ w.T over the weights, fastest first."""
    import nvmath  # lazy: optional, GPU-only

    mms = [nvmath.linalg.advanced.Matmul(x, w.t()) for w in weights]
    algos = [mm.plan(preferences={"limit": limit}) for mm in mms]
    ref = torch.mm(x, weights[0].t()).float()
    outs: list = [None] * len(weights)
    found = []
    for j, algo in enumerate(algos[0]):
        err = (mms[0].execute(algorithm=algo).float() - ref).abs().max().item()

        def run(j: int = j) -> None:
            stream = torch.cuda.current_stream()
            for i, mm in enumerate(mms):
                outs[i] = mm.execute(algorithm=algos[i][j], stream=stream)

        found.append((graph_us(run, reps=2) / len(weights), algo, err))
    return sorted(found, key=lambda item: item[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,128,256")
    parser.add_argument("--limit", type=int, default=24, help="candidates asked of cuBLASLt's heuristic per shape")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for name, (n, k, count) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs: list = [None] * count

            def cublas() -> None:
                for i, w in enumerate(weights):
                    outs[i] = torch.mm(x, w.t())

            base = graph_us(cublas, reps=2) / count
            found = candidates(x, weights, args.limit)
            top = "; ".join(
                f"tile {a.tile} split-K {a.split_k}: {us:.2f} us (diff {err:.3g})" for us, a, err in found[:3]
            )
            print(
                f"{name:16s} {m:4d} rows: cuBLAS {base:7.2f} us, best of {len(found)} cuBLASLt candidates "
                f"{found[0][0]:7.2f} us ({base / found[0][0]:.2f}x) | {top}"
            )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
