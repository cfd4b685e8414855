"""The Triton kernels behind layers/moe_gemv.py, and the routing kernel of layers/fused_moe.py's grouped path (both
route with top_k_softmax); imported on first use, and only where Triton imports."""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.layers.fused import gdc

gdc_wait, gdc_launch_dependents = gdc()


@triton.jit
def top_k_softmax(
    logits_ptr, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr
):
    """(weights [BLOCK_TOP] float32, ids [BLOCK_TOP]): the top_k of the softmax over one token's E router logits,
    renormalised over the k where RENORM. Ties go to the lowest index, as torch.topk's do; a row of NaNs (a padded
    graph row) still names experts. Both the grouped path's routing (layers/fused_moe.py) and the one-token kernels
    below route with it."""
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
def route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Every token's top_k experts and weights (one program a token): ids and weights [tokens, TOP_K]."""
    if PDL:  # launched early (programmatic dependent launch): the router's logits are complete from here on
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    top_w, top_i = top_k_softmax(logits_ptr + token * stride_t, num_experts, TOP_K, RENORM, BLOCK_E, BLOCK_TOP)
    slots = tl.arange(0, BLOCK_TOP)
    tl.store(weights_ptr + token * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, top_i, mask=slots < TOP_K)


@triton.jit
def moe_up_kernel(
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
    [2 INTER, K], gate and up each rounded to act's dtype first, as the grouped GEMM's output is. A program takes
    BLOCK_N rows of every one of the top_k experts at once ([BLOCK_TOP, BLOCK_N, BLOCK_K] tiles: many bytes in
    flight, which a one-row product bound by memory needs)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _, top_i = top_k_softmax(logits_ptr, E, TOP_K, RENORM, BLOCK_E, BLOCK_TOP)
    slots = tl.arange(0, BLOCK_TOP)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (slots < TOP_K)[:, None] & (rn < INTER)[None, :]  # [BLOCK_TOP, BLOCK_N]
    rows = top_i.to(tl.int64)[:, None] * stride_we + rn[None, :] * K  # each slot's expert, each row
    gate = tl.zeros((BLOCK_TOP, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_TOP, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        live_k = rk < K
        x = tl.load(x_ptr + rk, mask=live_k, other=0.0).to(tl.float32)[None, None, :]
        ptrs = w_ptr + rows[:, :, None] + rk[None, None, :]
        mask = live[:, :, None] & live_k[None, None, :]
        gate += tl.sum(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * x, axis=2)
        up += tl.sum(tl.load(ptrs + INTER * K, mask=mask, other=0.0).to(tl.float32) * x, axis=2)
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(act_ptr + slots[:, None] * INTER + rn[None, :], act, mask=live)


@triton.jit
def moe_down_kernel(
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
    grouped GEMM writes it before the top-k sum); the sum in float32, rounded once. A program takes BLOCK_N rows of
    every one of the top_k experts at once, as moe_up_kernel does."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    top_w, top_i = top_k_softmax(logits_ptr, E, TOP_K, RENORM, BLOCK_E, BLOCK_TOP)
    slots = tl.arange(0, BLOCK_TOP)
    live_slot = slots < TOP_K
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = rn < N
    live = live_slot[:, None] & live_n[None, :]
    rows = top_i.to(tl.int64)[:, None] * stride_we + rn[None, :] * K
    acc = tl.zeros((BLOCK_TOP, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        live_k = rk < K
        a = tl.load(act_ptr + slots[:, None] * K + rk[None, :], mask=live_slot[:, None] & live_k[None, :], other=0.0)
        w = tl.load(
            w_ptr + rows[:, :, None] + rk[None, None, :], mask=live[:, :, None] & live_k[None, None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
    dtype = out_ptr.dtype.element_ty
    terms = (acc * top_w[:, None]).to(dtype).to(tl.float32)  # padded slots: weight 0
    tl.store(out_ptr + rn, tl.sum(terms, axis=0).to(dtype), mask=live_n)
