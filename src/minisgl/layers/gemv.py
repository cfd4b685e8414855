"""One-row GEMMs (batch-1 decode) on a CUDA GPU: a Triton GEMV where it measures faster than cuBLAS.

At one row a linear is a matrix-vector product bound by reading its weight, and cuBLAS's heuristics do not always
read it fast: on an H200, Qwen3-0.6B's attention output projection (2,048 -> 1,024, bf16) took 12.1 us per call in
a CUDA graph against 4.8 us for the Triton kernel below, about 0.2 ms of a 1.5 ms decode step over its 28 layers
(docs/benchmarks.md). `tune(model)` times both, per distinct weight shape of the model, once after the weights are
loaded and before any CUDA graph is captured; a shape takes the GEMV only when it is at least MARGIN faster, so
that close calls (run-to-run noise) keep cuBLAS and a model's numbers do not depend on a coin toss. CpuGemm then
sends its one-row calls of those shapes here (its other calls, any row count above one, stay with F.linear).

The kernel: each program reduces BLOCK_N output channels over the whole input, BLOCK_K at a time, in fp32.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import torch

logger = logging.getLogger("minisgl")

MARGIN = 1.25  # the GEMV replaces cuBLAS only when cuBLAS takes at least this much longer
CONFIGS = ((4, 1024, 4), (8, 1024, 8), (8, 512, 4))  # (BLOCK_N, BLOCK_K, num_warps), measured on an H200
MAX_TUNED_BYTES = 64 << 20  # larger weights (an LM head) stream at full speed through cuBLAS already
CALLS = 28  # one timed CUDA graph replays this many calls, each on its own copy of the weight (not from L2)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@functools.cache
def _kernel() -> Any:
    import triton  # lazy: GPU-only
    import triton.language as tl  # lazy: GPU-only

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)

    return gemv_kernel


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """x [1, K] W^T (+ b) with W [N, K] contiguous: y [1, N] in x's dtype."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = ((n + config.block_n - 1) // config.block_n,)
    _kernel()[grid](
        x, weight, bias if bias is not None else weight, y, n, k, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
    )  # fmt: skip
    return y


def _graph_us(fn: Any) -> float:
    """Microseconds per call of fn (CALLS calls captured in one CUDA graph; the best of 3 timed sets of replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / 20 / CALLS)
    del graph
    return best


def choose(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig | None:
    """The GEMV config for one-row GEMMs of a weight [n, k], or None where cuBLAS (F.linear) is as fast."""
    weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(CALLS)]
    x = torch.randn(1, k, dtype=dtype, device=device)
    cublas = _graph_us(lambda i: torch.nn.functional.linear(x, weights[i]))
    best: tuple[float, GemvConfig] | None = None
    for config in map(GemvConfig._make, CONFIGS):
        us = _graph_us(lambda i, c=config: gemv(x, weights[i], None, c))
        if best is None or us < best[0]:
            best = (us, config)
    assert best is not None
    chosen = best[1] if cublas >= MARGIN * best[0] else None
    logger.info("one-row GEMM [%d x %d]: cuBLAS %.1f us, GEMV %.1f us -> %s", n, k, cublas, best[0],
                "GEMV" if chosen else "cuBLAS")  # fmt: skip
    return chosen


def tune(model: torch.nn.Module) -> int:
    """Set `gemm.gemv` on each module of model whose GEMM takes one (layers/linear.py's CpuGemm) and whose weight
    shape measures faster as a GEMV; how many modules. For bf16/fp16 weights on a CUDA GPU, before graph capture."""
    chosen: dict[tuple[int, int, torch.dtype], GemvConfig | None] = {}
    switched = 0
    for module in model.modules():
        gemm, weight = getattr(module, "gemm", None), getattr(module, "weight", None)
        if not hasattr(gemm, "gemv") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() != 2 or not weight.is_contiguous() or weight.numel() * weight.element_size() > MAX_TUNED_BYTES:
            continue
        key = (*weight.shape, weight.dtype)
        if key not in chosen:
            chosen[key] = choose(weight.shape[0], weight.shape[1], weight.dtype, weight.device)
        gemm.gemv = chosen[key]
        switched += chosen[key] is not None
    torch.cuda.empty_cache()
    return switched
