"""One GPU kernel from the QKV projection's output to attention's inputs (Triton, CUDA only).

Per token and head it does what five kernels do on the unfused path (q RMSNorm, k RMSNorm, RoPE on
q and k, and the two KV-pool stores): per-head RMSNorm (Qwen3's q_norm/k_norm, when the model has
them), neox-style RoPE from the float32 cos/sin cache, then q into a fresh [T, heads, head_dim]
tensor and k, v straight into their KV-pool slots. Everything is computed in float32 and rounded
once (the unfused path rounds after the norm too). At batch 1 each of the five launches costs ~2 µs
per layer, about a seventh of a Qwen3-0.6B decode step on an H100 (docs/benchmarks.md).

Used when the attention backend lets the layer store the KV itself (`kv_pool_for`), the tensors
are fp16/bf16 on CUDA, Triton imports and it can convert to the pool's dtype on this GPU (`stores_into`).

On Hopper and later the kernel is launched with programmatic dependent launch (PDL), as FlashInfer launches its
norms, activations and attention: it waits for the QKV projection at its first instruction (`gdc_wait`, before any
load or store) and lets attention launch at once, so the two launches overlap the kernels before them instead of
following them (`layers/fused.py: pdl_args`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minisgl.layers.fused import pdl_args

_DTYPES = (torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # pool dtypes whose stores saturate (kv_cache_dtype="fp8_*")


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; None when Triton is missing."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from minisgl.layers.fused_qkv_kernel import qkv_kernel  # lazy: the kernel's module imports triton (GPU-only)

    return qkv_kernel


def usable(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether fused_qkv can run on this tensor (CUDA, fp16/bf16, Triton importable, even head_dim)."""
    return qkv.is_cuda and qkv.dtype in _DTYPES and head_dim % 2 == 0 and _kernel() is not None


def stores_into(pool_dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether the kernel can write a KV pool of pool_dtype on a GPU of this compute capability: an FP8 pool only
    from 8.9 (Ada, Hopper), where the conversion is one instruction. Before, Triton has no float8_e4m3fn, and its
    emulated e5m2 conversion builds with some versions only (3.9's does for sm_80, 3.6's fails in ptxas), so there
    the unfused path stores (torch converts on any GPU)."""
    return pool_dtype not in _FP8 or capability >= (8, 9)


def fused_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    out: torch.Tensor | None = None,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """q [T, num_heads, head_dim] of qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]; k, v stored.

    cos_sin: [max_position, head_dim] float32 (cos of each frequency, then sin); q_norm, k_norm: the
    per-head RMSNorm weights (both or neither); k_cache, v_cache: [slots, num_kv_heads, head_dim]
    written at the slots out_loc [T] (in their dtype: an fp8 pool gets saturated, rounded values).
    out: a contiguous [T, num_heads, head_dim] tensor to write q into (a CUDA graph's static buffer).
    block_tokens, num_warps: the tokens and warps of a program (a power of two; default: block_config).
    """
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert (q_norm is None) == (k_norm is None)
    tokens = qkv.shape[0]
    if out is None:
        q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    else:
        assert out.shape == (tokens, num_heads, head_dim) and out.dtype == qkv.dtype and out.is_contiguous()
        q = out
    if tokens == 0:
        return q
    has_norm = q_norm is not None
    tb, warps = block_config(tokens)
    tb, warps = block_tokens or tb, num_warps or warps
    _kernel()[(-(-tokens // tb), num_heads + 2 * num_kv_heads)](
        qkv,
        qkv.stride(0),
        positions,
        cos_sin,
        cos_sin.stride(0),
        q_norm if has_norm else cos_sin,
        k_norm if has_norm else cos_sin,
        eps,
        q,
        k_cache,
        v_cache,
        k_cache.stride(0),
        out_loc,
        tokens,
        H=num_heads,
        HKV=num_kv_heads,
        D=head_dim,
        HAS_NORM=has_norm,
        TB=tb,
        num_warps=warps,
        KV_MAX=float(torch.finfo(k_cache.dtype).max) if k_cache.dtype in _FP8 else 0.0,
        **pdl_args(qkv.device),
    )
    return q


def block_config(tokens: int) -> tuple[int, int]:
    """(tokens per program, warps): one token a program for a few tokens, else blocks of 8, so that a large batch
    runs fewer, larger programs (one H100, tools/device/qkv_bench.py: 16,384 tokens 318 -> 97 µs, 256 tokens 6.5 ->
    2.8 µs, 8 tokens 1.8 µs either way)."""
    return (1, 1) if tokens <= 32 else (8, 4)
