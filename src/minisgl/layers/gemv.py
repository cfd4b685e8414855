"""GEMMs of one to four rows (decode of a few requests) on a CUDA GPU: a Triton GEMV where it measures faster than
cuBLAS.

At one row a linear is a matrix-vector product bound by reading its weight, and cuBLAS's heuristics do not always
read it fast: on an H200, Qwen3-0.6B's attention output projection (2,048 -> 1,024, bf16) took 12.1 us per call in
a CUDA graph against 4.8 us for the Triton kernel below, about 0.2 ms of a 1.5 ms decode step over its 28 layers
(docs/benchmarks.md). cuBLAS keeps that kernel up to four rows (10.8 us at 2 and 4 rows, 5.9 at 8), where a GEMV
that takes each weight tile against every row reads the weight once and takes 3.7 / 5.0 us. `tune(model)` times
both, per distinct weight shape of the model and per bucket of rows (1, 2, 3-4: ROW_BUCKETS), once after the
weights are loaded and before any CUDA graph is captured; a shape takes the GEMV only when it is at least MARGIN
faster, so that close calls (run-to-run noise) keep cuBLAS and a model's numbers do not depend on a coin toss.
CpuGemm then sends its calls of those shapes and row counts here (its other calls stay with F.linear).

A linear after an RMSNorm can also take the norm into its GEMV (`norm_gemv`): every program needs the whole input
rows anyway, so each computes the norm's sums of squares itself, one writes the residual sums, and the norm's launch
is gone; a gate_up projection also applies SiLU-and-mul to its output there. `tune` chooses it per (norm, linear)
pair that a model's layers name (`gemv_norm_pairs()`) and bucket of rows where it is at least FUSED_MARGIN faster
than the kernels apart (on an H200 for Qwen3-0.6B, before the narrower tiles: 1.05 against 1.19 ms a decode step at
batch 1; with them 0.88 ms, docs/benchmarks.md).

The kernels (layers/gemv_kernel.py): each program reduces BLOCK_N output channels over the whole input, BLOCK_K at a
time, in fp32, launched with programmatic dependent launch where the GPU has it; one kernel for one row, one for 2-4
rows (its row count rounded up to a power of two, the rows past it masked), which takes each weight tile against
every row and sums the products along K block by block or, at 3-4 rows where that times faster, once after the last
block (DEFERRED_CONFIGS).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple

import torch

from minisgl.layers.fused import pdl_args

logger = logging.getLogger("minisgl")

MARGIN = 1.25  # the GEMV replaces cuBLAS only when cuBLAS takes at least this much longer
FUSED_MARGIN = 1.1  # the norm and its GEMM in one kernel only when the two apart take at least this much longer
# (BLOCK_N, BLOCK_K, num_warps) tried for each shape: fewer output rows a program, more programs and loads in flight.
CONFIGS = ((4, 1024, 4), (8, 1024, 8), (8, 512, 4), (2, 1024, 4), (2, 2048, 4), (1, 2048, 4))
# The same for 2-4 rows: those that won some shape of the 0.6B and 30B-A3B shapes' linears at 2 or 4 rows (1x H200);
# wider tiles hold ROWS x BLOCK_N x BLOCK_K products in registers.
ROWS_CONFIGS = ((4, 1024, 4), (2, 1024, 4))
# At 3-4 rows also tiles that sum the products along K after the last block (the fourth field, gemv_rows_kernel's
# DEFER): the down projection of the 0.6B shape at 4 rows in 5.7 us against 7.0 and cuBLAS's 7.5; a decode step of 3-4
# requests 1.25 against 1.32 ms (1x H200, docs/benchmarks.md). At 2 rows the GEMV keeps the tilings above.
DEFERRED_CONFIGS = ((2, 512, 4, True), (4, 512, 4, True))
ROW_BUCKETS = (1, 2, 4)  # a call of m rows runs the kernel of rows_bucket(m) rows (its rows past m masked)
MAX_TUNED_BYTES = 64 << 20  # larger weights (an LM head) stream at full speed through cuBLAS already
CALLS = 28  # one timed CUDA graph replays this many calls, each on its own copy of the weight (not from L2)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    defer: bool = False  # sum the products along K after the last block (tune: 3-4 rows; one-row calls ignore it)


@functools.cache
def _kernel() -> Any:
    from minisgl.layers.gemv_kernel import gemv_kernel  # lazy: the kernel's module imports triton (GPU-only)

    return gemv_kernel


@functools.cache
def _rows_kernel() -> Any:
    from minisgl.layers.gemv_kernel import gemv_rows_kernel  # lazy, as _kernel

    return gemv_rows_kernel


def rows_bucket(m: int) -> int:
    """The bucket of ROW_BUCKETS that a call of m rows falls in (the smallest with room for them), 0 above them."""
    return next((b for b in ROW_BUCKETS if m <= b), 0) if m > 0 else 0


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """x [M, K] W^T (+ b) for 1 <= M <= ROW_BUCKETS[-1] rows (each row contiguous) with W [N, K] contiguous: y [M, N]
    in x's dtype."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(config, x, weight, bias, y)
    return y


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual'): y = RMSNorm(x + residual) W^T (+ b) for the 1 <= M <= ROW_BUCKETS[-1] rows of x [M, K]
    (RMSNorm(x) where residual is None; each row normed on its own), and residual' = x + residual (x itself where
    None), in one kernel instead of a norm and a GEMM. gated: W [2N, K] holds the gate rows, then the up rows, and
    y = silu(gate) * up, [M, N] (no bias)."""
    assert (residual is None or residual.is_contiguous()) and not (gated and bias is not None)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(residual)
    _launch(config, x, weight, bias, y, residual, res_out, norm_weight, eps, gated)
    return y, res_out


def _launch(
    config: GemvConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    residual: torch.Tensor | None = None,
    res_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
) -> None:
    m, n, k = x.shape[0], y.shape[-1], weight.shape[1]
    assert 1 <= m <= ROW_BUCKETS[-1] and x.stride(-1) == 1
    grid = (-(-n // config.block_n),)
    args = (
        x,
        residual if residual is not None else x,
        res_out if res_out is not None else x,
        norm_weight if norm_weight is not None else weight,
        eps,
        weight,
        bias if bias is not None else weight,
        y,
    )
    flags = dict(
        NORM=norm_weight is not None,
        ADD=residual is not None,
        GATED=gated,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        **pdl_args(x.device),
    )
    if m == 1:
        _kernel()[grid](*args, n, k, **flags)
    else:
        _rows_kernel()[grid](*args, m, x.stride(0), n, k, ROWS=rows_bucket(m), DEFER=config.defer, **flags)


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


def configs_for(rows: int) -> tuple[tuple, ...]:
    """The tilings that tune tries for calls of `rows` rows (a bucket of ROW_BUCKETS)."""
    return CONFIGS if rows == 1 else ROWS_CONFIGS + (DEFERRED_CONFIGS if rows >= 4 else ())


def _fastest(us_of: Callable[[GemvConfig], float], configs: tuple[tuple, ...]):
    """(microseconds, config) of the fastest of configs, us_of timing one (the first among equals)."""
    timed = [(us_of(config), config) for config in (GemvConfig(*c) for c in configs)]
    return min(timed, key=lambda t: t[0])


def choose(n: int, k: int, dtype: torch.dtype, device: torch.device, rows: int = 1) -> GemvConfig | None:
    """The GEMV config for GEMMs of `rows` rows (a bucket of ROW_BUCKETS) and a weight [n, k], or None where cuBLAS
    (F.linear) is as fast."""
    weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(CALLS)]
    x = torch.randn(rows, k, dtype=dtype, device=device)
    cublas = _graph_us(lambda i: torch.nn.functional.linear(x, weights[i]))
    best = _fastest(lambda c: _graph_us(lambda i: gemv(x, weights[i], None, c)), configs_for(rows))
    chosen = best[1] if cublas >= MARGIN * best[0] else None
    logger.info("%d-row GEMM [%d x %d]: cuBLAS %.1f us, GEMV %.1f us -> %s", rows, n, k, cublas, best[0],
                "GEMV" if chosen else "cuBLAS")  # fmt: skip
    return chosen


def choose_fused(norm: torch.nn.Module, linear: torch.nn.Module, gated: bool, rows: int = 1) -> GemvConfig | None:
    """The config of norm_gemv for `rows` rows (a bucket of ROW_BUCKETS) of a norm and the linear it feeds, or None
    where the two (and SiLU-and-mul where gated) as they run unfused, the linear through its own route (set by tune),
    are as fast."""
    weight = linear.weight
    weights = [torch.randn_like(weight) for _ in range(CALLS)]
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    residual = torch.randn_like(x)
    act = None
    if gated:
        from minisgl.layers.activation import SiluAndMul  # lazy: activation imports flashinfer's module loader

        act = SiluAndMul()

    def unfused(i: int) -> None:
        h, _ = norm(x, residual)  # flashinfer's fused add + RMSNorm, in place
        y = linear.gemm(h, weights[i], None)
        if act is not None:
            act(y)

    separate = _graph_us(unfused)
    best = _fastest(
        lambda c: _graph_us(lambda i: norm_gemv(x, residual, norm.weight, norm.eps, weights[i], None, c, gated)),
        configs_for(rows),
    )
    chosen = best[1] if separate >= FUSED_MARGIN * best[0] else None
    logger.info("%d-row norm + GEMM [%d x %d]%s: separate %.1f us, fused %.1f us -> %s", rows, *weight.shape,
                " + SiLU-and-mul" if gated else "", separate, best[0], "fused" if chosen else "separate")  # fmt: skip
    return chosen


def fused_norm_linear(
    norm: torch.nn.Module, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """norm_gemv for the norm and the linear after it where tune chose it for them at x's row count (else None: the
    caller runs them apart). Returns (linear(norm(x + residual)), x + residual), gated: silu(gate) * up."""
    configs = getattr(linear.gemm, "norm_gemv", None)
    if not configs or x.dim() != 2 or x.stride(-1) != 1 or (config := configs.get(rows_bucket(x.shape[0]))) is None:
        return None
    return norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, config, gated)


def tune(model: torch.nn.Module, fuse: bool = True, max_rows: int = ROW_BUCKETS[-1]) -> int:
    """Set `gemm.gemv` ({rows bucket: config}) on each module of model whose GEMM takes one (layers/linear.py's
    CpuGemm): the buckets of rows (up to max_rows) where its weight shape measures faster as a GEMV; how many modules
    got one for some row count. fuse: then `gemm.norm_gemv` ({rows bucket: config}) on the linears that the modules'
    `gemv_norm_pairs()` name, [(norm, linear, gated)], at the buckets where norm_gemv measures faster than the two
    apart. For bf16/fp16 weights on a CUDA GPU and one rank, before graph capture."""
    buckets = [rows for rows in ROW_BUCKETS if rows <= max_rows]
    chosen: dict[tuple[int, int, torch.dtype], dict[int, GemvConfig]] = {}
    switched = 0
    for module in model.modules():
        gemm, weight = getattr(module, "gemm", None), getattr(module, "weight", None)
        if not hasattr(gemm, "gemv") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() != 2 or not weight.is_contiguous() or weight.numel() * weight.element_size() > MAX_TUNED_BYTES:
            continue
        key = (*weight.shape, weight.dtype)
        if key not in chosen:
            configs = {rows: choose(*key[:2], weight.dtype, weight.device, rows) for rows in buckets}
            chosen[key] = {rows: config for rows, config in configs.items() if config is not None}
        gemm.gemv = chosen[key]
        switched += bool(chosen[key])
    fused: dict[tuple[int, int, torch.dtype, bool], dict[int, GemvConfig]] = {}
    for module in model.modules() if fuse else ():
        for norm, linear, gated in getattr(module, "gemv_norm_pairs", lambda: ())():
            if not hasattr(linear.gemm, "norm_gemv") or linear.tp_size != 1 or (gated and linear.bias is not None):
                continue  # under tensor parallelism the norm all-reduces its input first
            key = (*linear.weight.shape, linear.weight.dtype, gated)
            if key not in fused:
                configs = {rows: choose_fused(norm, linear, gated, rows) for rows in buckets}
                fused[key] = {rows: config for rows, config in configs.items() if config is not None}
            linear.gemm.norm_gemv = fused[key]
    torch.cuda.empty_cache()
    return switched
