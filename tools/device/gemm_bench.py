"""GPU time of the decode GEMMs of the Qwen3-0.6B shape (qkv, o, gate_up, down, LM head), replayed from a CUDA
graph as decode runs them, for cuBLAS and cuBLASLt, against the weight-read floor (bytes / 3.0 TB/s).

    python3 tools/device/gemm_bench.py        # after `source tools/device/env.sh`; one line per (rows, library)
"""

import torch

DEV = "cuda"
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]  # (in, out) features
BANDWIDTH = 3.0e12  # bytes/s, about the H100's measured copy bandwidth (docs/benchmarks.md)


def gpu_us(rows: int, lib: str, weights: list[torch.Tensor], reps: int = 200) -> dict[str, str]:
    torch.backends.cuda.preferred_blas_library(lib)
    out = {}
    for (k, n), w in zip(SHAPES, weights):
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        y = torch.empty(rows, n, device=DEV, dtype=torch.bfloat16)
        for _ in range(3):
            torch.mm(x, w.t(), out=y)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                torch.mm(x, w.t(), out=y)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps // 20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / reps
        floor = (k * n + rows * (k + n)) * 2 / BANDWIDTH * 1e6
        out[f"{k}x{n}"] = f"{us:.1f}us({floor / us:.0%})"
    return out


def main() -> None:
    weights = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for k, n in SHAPES]
    for rows in (8, 32, 64, 128, 256):
        for lib in ("cublas", "cublaslt"):
            print(rows, lib, gpu_us(rows, lib, weights), flush=True)


if __name__ == "__main__":
    main()
