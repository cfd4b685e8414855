"""The Triton kernels behind layers/moe_gemv.py; imported on first use, and only where Triton imports."""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.layers.fused import gdc

gdc_wait, gdc_launch_dependents = gdc()


@triton.jit
def _top_k(logits_ptr, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    """(weights [BLOCK_TOP] float32, ids [BLOCK_TOP]): the top_k of the softmax over the E router logits, as
    layers/fused_moe.py's route_kernel picks them (the lowest index among ties, a row of NaNs still names experts)."""
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p / tl.sum(p, axis=0), -1.0)
    slots = tl.arange(0, BLOCK_TOP)
    top_w = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_TOP,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        idx = tl.minimum(idx, E - 1)
        top_w = tl.where(slots == k, best, top_w)
        top_i = tl.where(slots == k, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_i


@triton.jit
def up_kernel(
    logits_ptr,
    x_ptr,
    w_ptr,
    act_ptr,
    E,
    INTER,
    stride_we,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """act [TOP_K, INTER]: row k = silu(gate) * up of the token x [K] through its k-th expert's gate_up
    [2 INTER, K], gate and up each rounded to act's dtype first, as the grouped GEMM's output is. Program (k,
    n-block)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    slot = tl.program_id(0)
    _, top_i = _top_k(logits_ptr, E, TOP_K, RENORM, BLOCK_E, BLOCK_TOP)
    expert = tl.sum(tl.where(tl.arange(0, BLOCK_TOP) == slot, top_i, 0), axis=0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = rn < INTER
    w = w_ptr + expert * stride_we
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        live_k = rk < K
        x = tl.load(x_ptr + rk, mask=live_k, other=0.0).to(tl.float32)[None, :]
        mask = live_n[:, None] & live_k[None, :]
        gate += tl.sum(tl.load(w + rn[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(
            tl.load(w + (INTER + rn)[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1
        )
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    tl.store(act_ptr + slot * INTER + rn, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=live_n)


@triton.jit
def down_kernel(
    logits_ptr,
    act_ptr,
    w_ptr,
    out_ptr,
    E,
    N,
    stride_we,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out [N] = sum_k weight_k * (down[expert_k] [N, K] @ act[k]), each term rounded to out's dtype first (as the
    grouped GEMM writes it before the top-k sum); the sum in float32, rounded once. Program: an n-block."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    top_w, top_i = _top_k(logits_ptr, E, TOP_K, RENORM, BLOCK_E, BLOCK_TOP)
    slots = tl.arange(0, BLOCK_TOP)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = rn < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots == slot, top_i, 0), axis=0).to(tl.int64)
        weight = tl.sum(tl.where(slots == slot, top_w, 0.0), axis=0)
        w = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            live_k = rk < K
            a = tl.load(act_ptr + slot * K + rk, mask=live_k, other=0.0).to(tl.float32)[None, :]
            mask = live_n[:, None] & live_k[None, :]
            acc += tl.sum(tl.load(w + rn[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32) * a, axis=1)
        total += (acc * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + rn, total.to(dtype), mask=live_n)
