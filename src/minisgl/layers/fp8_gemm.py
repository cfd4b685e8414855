"""FP8 GEMMs on the GPU: y = x W^T with W held in e4m3 and one float32 scale per output channel.

A model served in FP8 on CUDA (quantization="fp8", or an FP8 checkpoint) keeps each linear's weight as
Q [N, K] float8_e4m3fn and scale [N] float32, W ~= Q * scale[:, None] (layers/quantize.py converts them after the
load). Three kernels compute the product, chosen by the number of rows M:

- one row (decode of one request, `weight_only_rows()`): a Triton GEMV that reads the FP8 weight, widens it in
  registers and applies the scale to the sum (W8A16, `weight_only`). The step is bound by the weight bytes, which
  FP8 halves; x is not quantized, so the row loses nothing but the weights' rounding. (Raising
  MINISGL_FP8_WEIGHT_ONLY_ROWS sends more rows to a tensor-core W8A16 kernel; the FP8 x FP8 kernel is faster there.)
- decode batches (up to `w8a8_rows()`): x quantized to e4m3 per row (one Triton kernel: max |x| of the row, then
  the scaled cast; the norm before the QKV and gate_up projections does it as it writes x), then a Triton FP8 x FP8
  kernel with tiles for few rows (`w8a8`, `w8a8_config`): half the bytes of bf16's GEMM and the FP8 tensor cores.
- more rows (prefill, the largest decode batches): the same quantized x into torch._scaled_mm with row-wise scales
  (cuBLASLt/CUTLASS FP8 tensor cores, Hopper and later), the output in x's dtype.

Up to w8a8_rows() the MLP's gate_up GEMM also applies SiLU-and-mul in its epilogue (`Fp8Gemm.gate_up_silu`).
On Hopper the Triton kernels launch with programmatic dependent launch, and the GEMV reads its first weight tile
before it waits for the kernels before it (layers/fp8_gemm_kernels.py).

Every shape is static for a given M and nothing syncs with the host, so both replay from CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minisgl import env
from minisgl.layers.fused import pdl_args

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def weight_only_rows() -> int:
    """Up to this many rows the W8A16 kernels run (MINISGL_FP8_WEIGHT_ONLY_ROWS), above it the FP8 x FP8 GEMMs."""
    return env.FP8_WEIGHT_ONLY_ROWS.get()


@functools.cache
def _kernels() -> dict[str, Any]:
    """The Triton kernels (layers/fp8_gemm_kernels.py), imported on first use: "quant_rows", "w8a16" and "gemv"."""
    from minisgl.layers import fp8_gemm_kernels as k  # lazy: the kernels' module imports triton (GPU-only)

    return {
        "quant_rows": k.quant_rows_kernel,
        "w8a16": k.w8a16_gemm_kernel,
        "gemv": k.gemv_kernel,
        "w8a8": k.w8a8_gemm_kernel,
        "add_rmsnorm": k.add_rmsnorm_kernel,
    }


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quantize_for: Fp8Gemm | None = None
) -> None:
    """flashinfer's fused_add_rmsnorm (in place: residual += x, x = RMSNorm(residual) * weight) for x [T, H] on
    CUDA, as a kernel that lets the next one launch before it computes (PDL): the norms before FP8 GEMMs take it
    (RMSNorm.early_dependents), so a GEMM reads its first weight tiles while the norm runs. Before the one-row GEMV
    it does so before it even waits for the kernel before it (3.23 -> 3.08 ms a Qwen3-8B token on an H200); before
    the multi-row kernels, whose waiting programs would hold SMs the previous GEMM still needs, only after.
    quantize_for: the FP8 GEMM that x feeds; above weight_only_rows() the kernel also quantizes x per row and hands
    it that GEMM (Fp8Gemm.hand_over), which then skips its own quantization kernel."""
    tokens, hidden = x.shape
    if not tokens:
        return
    quant = quantize_for is not None and tokens > weight_only_rows()
    q = torch.empty(tokens, hidden, dtype=FP8, device=x.device) if quant else x
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device) if quant else x
    block = 1 << (hidden - 1).bit_length()
    _kernels()["add_rmsnorm"][(tokens,)](
        x, residual, weight, q, scale, hidden, eps, x.stride(0), residual.stride(0), q.stride(0), FP8_MAX, quant,
        EARLY=tokens <= GEMV_MAX_ROWS, BLOCK=block, num_warps=min(16, max(4, block // 512)), **pdl_args(x.device),
    )  # fmt: skip
    if quant and quantize_for is not None:
        quantize_for.hand_over(x, q, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] float32) with x ~= q * scale, one scale per row."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, max(128, 1 << (k - 1).bit_length()))
        _kernels()["quant_rows"][(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX, BLOCK=block, num_warps=4, **pdl_args(x.device)
        )
    return q, scale


# One row (decode of one request) on the CUDA cores: a Qwen3-8B layer's four GEMMs in 54 us against bf16's 103 on an
# H200 (tools/device/fp8_gemm_bench.py's sweep); at 4 rows the tensor-core kernel is faster (111 against 194 us).
GEMV_MAX_ROWS = 1
GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=2)


def gemv_config(n: int, k: int) -> dict[str, int]:
    """The GEMV's tiles for an [n, k] weight: long rows (k >= 8192) split over twice the programs (Qwen3-8B's down
    projection 15.4 against 16.4 us), wide weights (n >= 6144) in short tiles on two warps (qkv 6.3 against 7.2,
    gate_up 27.8 against 29.7 us), GEMV_CONFIG otherwise (o, 4.3 us)."""
    if k >= 8192:
        return dict(BLOCK_N=4, BLOCK_K=2048, num_warps=4, num_stages=2)
    if n >= 6144:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=2, num_stages=3)
    return GEMV_CONFIG


# The tensor-core W8A16 kernel's tiles (rows 2 to MINISGL_FP8_WEIGHT_ONLY_ROWS when it is raised): a Qwen3-8B layer's
# four GEMMs at 2-16 rows in 86-93 us against bf16's 103-108 and the W8A8 kernel's 77-85, quantization included, on
# an H200 (tools/device/fp8_gemm_bench.py's table); taller tiles were slower (160 us at 32 rows with BLOCK_M 32).
W8A16_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)


def weight_only(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    gate_up: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp16/bf16) @ (qweight [N, K] e4m3 * scale [N])^T -> [M, N] in x's dtype, the weight widened in the
    kernel: the CUDA-core GEMV up to GEMV_MAX_ROWS rows, the tensor-core kernel above; config overrides its tiles.
    gate_up: qweight is an MLP's gate_up weight [2N, K] and the result silu(gate) * up [M, N]."""
    m, k = x.shape
    n = qweight.shape[0] // 2 if gate_up else qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    if m <= GEMV_MAX_ROWS:
        cfg: dict[str, int] = {**gemv_config(qweight.shape[0], k), "ROWS": m}
        if gate_up:  # a program reads BLOCK_N rows of gate and as many of up
            cfg["BLOCK_N"] = max(1, cfg["BLOCK_N"] // 2)
        cfg.update(config or {})
        kernel, grid = _kernels()["gemv"], (-(-n // cfg["BLOCK_N"]),)
    else:
        cfg = {**W8A16_CONFIG, **(config or {})}
        kernel, grid = _kernels()["w8a16"], (-(-n // cfg["BLOCK_N"]), -(-m // cfg["BLOCK_M"]))
    kernel[grid](
        x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0), GATE_UP=gate_up, **cfg,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


def w8a8_rows() -> int:
    """Up to this many rows (decode batches) x is quantized per row and multiplied on the FP8 tensor cores by a
    Triton kernel whose tiles suit few rows (w8a8_config); above it by torch._scaled_mm, whose tiles suit prefill
    (MINISGL_FP8_W8A8_ROWS, default 64: with the quantization kernel included, as the o and down projections run
    it, torch._scaled_mm was the faster from 96 rows on an H200, 108 against 137 us a Qwen3-8B layer)."""
    return env.FP8_W8A8_ROWS.get()


def w8a8_config(m: int, gate_up: bool) -> dict[str, int]:
    """The FP8 x FP8 kernel's tiles for m rows, from tools/device/fp8_gemm_bench.py's sweep over a Qwen3-8B layer's
    weights on an H200 (gate_up: two weight tiles a step, so fewer stages fit). A layer's four GEMMs, us, against
    bf16's cuBLAS and torch._scaled_mm: 16 rows 65.6 / 109.7 / 114.0, 64 rows 79.9 / 110.0 / 104.6, 128 rows
    91.1 / 118.1 / 101.1; at 192 rows the two FP8 kernels tie, at 256 torch._scaled_mm is faster (110.5 / 128.5)."""
    if m <= 16:
        tiles = (16, 64, 256, 3) if gate_up else (16, 32, 256, 5)
    elif m <= 32:
        tiles = (32, 64, 256, 3) if gate_up else (16, 64, 256, 5)
    elif m <= 64:
        tiles = (64, 32, 128, 3 if gate_up else 5)
    else:
        tiles = (128, 32, 128, 3 if gate_up else 5)
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages")
    return dict(zip(names, tiles)) | {"num_warps": 8 if tiles[0] == 128 else 4}


def w8a8(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    gate_up: bool = False,
) -> torch.Tensor:
    """(qx [M, K] e4m3 * sx [M, 1]) @ (qweight [N, K] e4m3 * scale [N])^T -> [M, N] in out_dtype, on the FP8
    tensor cores; config overrides the tiles. gate_up: as weight_only's."""
    m, k = qx.shape
    n = qweight.shape[0] // 2 if gate_up else qweight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=qx.device) if out is None else out
    if m == 0:
        return out
    cfg = {**w8a8_config(m, gate_up), **(config or {})}
    grid = (-(-m // cfg["BLOCK_M"]), -(-n // cfg["BLOCK_N"]))
    _kernels()["w8a8"][grid](
        qx, sx, qweight, scale, out, m, n, k, qx.stride(0), qweight.stride(0), out.stride(0), GATE_UP=gate_up, **cfg,
        **pdl_args(qx.device),
    )  # fmt: skip
    return out


def fp8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x (qweight * scale)^T (+ bias) for x [..., K] on CUDA, in x's dtype; into out [M, N] if given.
    quantized: x already quantized per row (quantize_rows' (q, scale), made by the norm before)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows <= weight_only_rows():
        y = weight_only(x2, qweight, scale, out)
    else:
        qx, sx = quantized if quantized is not None else quantize_rows(x2)
        if rows <= w8a8_rows():
            y = w8a8(qx, sx, qweight, scale, x.dtype, out)
        else:
            y = torch._scaled_mm(qx, qweight.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype)
            if out is not None:
                out.copy_(y)
                y = out
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class Fp8Gemm:
    """A linear's gemm (LinearBase.gemm) once its weight is FP8: the same call, y = gemm(x, weight, bias), with
    weight the layer's e4m3 parameter and the per-channel scales held here."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale
        self._handed: tuple[int, torch.Size, torch.Tensor, torch.Tensor] | None = None

    def hand_over(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        """x's per-row quantization (q, scale), made by the norm that wrote x: the next call on x uses it."""
        self._handed = (x.data_ptr(), x.shape, q, scale)

    def _take(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The handed-over quantization if this call's input is the tensor it was made from; cleared either way."""
        handed, self._handed = self._handed, None
        if handed is None or handed[0] != x.data_ptr() or handed[1] != x.shape:
            return None
        return handed[2], handed[3]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, self.scale, bias, quantized=self._take(x))

    def into(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """out [M, N] = the same product, written where the caller says (CpuGemm.into's counterpart)."""
        fp8_linear(x, weight, self.scale, bias, out=out, quantized=self._take(x))

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of an MLP's gate_up weight [2I, K] in one kernel (no bias) where the weight-only or the
        W8A8 kernel takes x's rows: [..., I]; None above, where the caller runs the GEMM and SiLU-and-mul apart."""
        x2 = x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if rows > w8a8_rows():
            return None
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        quantized = self._take(x)
        if rows <= weight_only_rows():
            y = weight_only(x2, weight, self.scale, gate_up=True)
        else:
            y = w8a8(*(quantized or quantize_rows(x2)), weight, self.scale, x.dtype, gate_up=True)
        return y.view(*x.shape[:-1], y.shape[-1])


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 of the same shape, scale [..., N] float32): one scale (max |w| / 448) per row."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (w / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 GEMMs run here: a bf16 model (the row-wise scaled GEMM's output) on a CUDA device of compute capability
    9.0 or later, with Triton."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
