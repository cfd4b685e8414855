"""An experiment, not used by the engine: a split-K Triton GEMM for decode's narrow projections, y = x W^T.

Session 15 asked whether the decode GEMMs (~4-8 µs each at 1-256 rows on an H100, ~1/3 of the weight-read
floor) lose their time to cuBLAS's few output tiles. Here the K axis is cut into `splits` slices too, so
~100+ programs read the weight at once; each writes its float32 partial tile to a workspace and bumps the
tile's counter, and the program that arrives last sums the partials in slice order (deterministic: the
same bits on every run) and writes the output, in one kernel. Options: programmatic dependent launch
(`pdl`: the kernel may start while the previous one drains, `gdc_wait` before reading x) and an L2
prefetch of the program's weight slice before that wait (`prefetch`).

Answer (docs/benchmarks.md, session 15): no. In tools/device/splitk_bench.py it ties cuBLAS (both with the
weight warm in L2); in the 28-layer chain of tools/device/gemm_chain_probe.py (weights cold, flashinfer's
norms in between) it is slower from 64 rows up, 2% faster at <= 32 rows only with PDL, and the prefetch
makes it slower. Each GEMM costs ~4-5 µs whatever it reads: a launch-and-pipeline floor, not the tiling.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Config:
    """One launch shape: rows, columns and K of a program's tile, K slices, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    warps: int = 4
    stages: int = 4

    def fits(self, n: int, k: int) -> bool:
        return n % self.block_n == 0 and k % (self.block_k * self.splits) == 0


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use."""
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _prefetch_l2(ptrs):
        return tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )

    @triton.jit(do_not_specialize=["M", "SPLITS"])
    def splitk_kernel(
        x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, x_stride, w_stride, y_stride,
        SPLITS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
        PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        iters = K // (SPLITS * BK)
        k_start = pid_s * iters * BK
        if PREFETCH_LINES > 0:  # this program's weight slice into L2 (the weights do not depend on the previous kernel)
            line = tl.minimum(tl.arange(0, PREFETCH_LINES) * 64, iters * BK - 64)
            _prefetch_l2(w_ptr + rn[:, None] * w_stride + (k_start + line)[None, :])
        if PDL:
            gdc_wait()  # the previous kernel's outputs (x) are complete and visible from here on
            gdc_launch_dependents()
        k0 = k_start + tl.arange(0, BK)  # a multiple of BK: Triton sees the alignment and vectorizes
        live = rm[:, None] < M
        # int32 offsets (config_for keeps M x K and N x K below 2^31); pointers advanced in the loop, the
        # form Triton's pipeliner turns into asynchronous copies
        a_ptrs = x_ptr + rm[:, None] * x_stride + k0[None, :]
        b_ptrs = w_ptr + rn[None, :] * w_stride + k0[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, iters):
            a = tl.load(a_ptrs, mask=live, other=0.0)
            b = tl.load(b_ptrs)
            if UPCAST:  # Triton's interpreter (CPU): its dot of bf16 operands is wrong, float32 is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        out = y_ptr + rm[:, None] * y_stride + rn[None, :]
        if SPLITS == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=live)
        else:
            tile = pid_m * tl.num_programs(0) + pid_n
            tile_elems = BM * BN
            cell = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            ws_tile = ws_ptr + tile.to(tl.int64) * SPLITS * tile_elems
            tl.store(ws_tile + pid_s * tile_elems + cell, acc)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the last of the tile's programs: sum the slices in order
                total = tl.load(ws_tile + cell, cache_modifier=".cg")
                for s in range(1, SPLITS):
                    total += tl.load(ws_tile + s * tile_elems + cell, cache_modifier=".cg")
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=live)
                tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (and the next graph replay)

    return splitk_kernel


class Workspace:
    """The float32 partial tiles and the per-tile counters, one set per device, made once and reused by every
    call (calls on one stream run one after another; the last program of a tile resets its counter)."""

    FLOATS = 2 << 20  # 8 MiB of partials: 256 rows x 1,024 columns x 8 slices
    TILES = 4096
    _by_device: dict[torch.device, "Workspace"] = {}

    def __init__(self, device: torch.device) -> None:
        self.partials = torch.empty(self.FLOATS, dtype=torch.float32, device=device)
        self.counters = torch.zeros(self.TILES, dtype=torch.int32, device=device)

    @classmethod
    def on(cls, device: torch.device) -> "Workspace":
        ws = cls._by_device.get(device)
        if ws is None:
            ws = cls._by_device[device] = cls(device)
        return ws


def splitk_mm(
    x: torch.Tensor, weight: torch.Tensor, cfg: Config, out: torch.Tensor | None = None, pdl: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, float32 accumulation, K cut into cfg.splits slices."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and cfg.fits(n, k) and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    grid = (n // cfg.block_n, -(-m // cfg.block_m), cfg.splits)
    ws = Workspace.on(x.device)
    assert grid[0] * grid[1] * cfg.splits * cfg.block_m * cfg.block_n <= ws.partials.numel()
    assert grid[0] * grid[1] <= ws.counters.numel()
    _kernel()[grid](
        x, weight, y, ws.partials, ws.counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        SPLITS=cfg.splits, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, UPCAST=not x.is_cuda, num_warps=cfg.warps,
        num_stages=cfg.stages, PDL=pdl, PREFETCH_LINES=_pow2(k // cfg.splits // 64) if prefetch else 0,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
