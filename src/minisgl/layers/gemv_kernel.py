"""The Triton kernel behind layers/gemv.py; imported on first use, and only where Triton imports."""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.layers.fused import gdc

gdc_wait, gdc_launch_dependents = gdc()


@triton.jit
def gemv_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y [N] = f(x) W^T (+ b) for one row x [K]; each program BLOCK_N outputs over all of K, in float32.

    NORM: f(x) = RMSNorm(x (+ residual where ADD)) with weight norm_ptr, as flashinfer's (fused_add_)rmsnorm
    computes it (sum in float32, the sum written to res_out_ptr in x's dtype by program 0, x * rstd * weight
    rounded once to x's dtype); else f(x) = x. GATED: W holds 2N rows (gate, then up) and y = silu(gate) * up,
    each product first rounded to y's dtype as the unfused GEMM's output is."""
    if PDL:  # launched early (programmatic dependent launch): the previous kernel's output is complete from here on
        gdc_wait()
        gdc_launch_dependents()
    dtype = y_ptr.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = rn < N
    rstd = 1.0
    if NORM:
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            if ADD:
                v += tl.load(res_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        live_k = rk < K
        x = tl.load(x_ptr + rk, mask=live_k, other=0.0).to(tl.float32)
        if NORM:
            if ADD:
                x += tl.load(res_ptr + rk, mask=live_k, other=0.0).to(tl.float32)
                if tl.program_id(0) == 0:
                    tl.store(res_out_ptr + rk, x.to(dtype), mask=live_k)
            w_norm = tl.load(norm_ptr + rk, mask=live_k, other=0.0).to(tl.float32)
            x = (x * rstd * w_norm).to(dtype).to(tl.float32)
        mask = live_n[:, None] & live_k[None, :]
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            w_up = tl.load(w_ptr + (N + rn)[:, None] * K + rk[None, :], mask=mask, other=0.0)
            acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=live_n, other=0.0).to(tl.float32)
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rn, acc.to(dtype), mask=live_n)


@triton.jit
def _rows_rstd(
    x_ptr,
    res_ptr,
    eps,
    rm,
    live_m,
    stride_x,
    K: tl.constexpr,
    ADD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """RMSNorm's 1 / rms of each row rm of x (+ the residual where ADD), summed in float32 as gemv_kernel's."""
    squares = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = live_m[:, None] & (rk < K)[None, :]
        v = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        if ADD:
            v += tl.load(res_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        squares += v * v
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit(do_not_specialize=["M", "stride_x"])
def gemv_rows_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    stride_x,
    N,
    K: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DEFER: tl.constexpr,
    PDL: tl.constexpr,
):
    """gemv_kernel for the M <= ROWS rows of x (row stride stride_x; the residuals and y contiguous): each program
    loads its [BLOCK_N, BLOCK_K] tiles of W once and takes them against every row (a [ROWS, BLOCK_N, BLOCK_K]
    product, in float32); NORM, ADD, GATED and HAS_BIAS as there, row by row. By default it sums each block's products
    along K; DEFER keeps them apart and sums them after the last block (one cross-lane sum, more registers). Rows past M
    are masked: ROWS is M rounded up to a power of two, so that one compiled kernel serves a bucket of row counts."""
    if PDL:  # as gemv_kernel: the previous kernel's output is complete from here on
        gdc_wait()
        gdc_launch_dependents()
    dtype = y_ptr.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, ROWS)
    live_n, live_m = rn < N, rm < M
    rstd = tl.full((ROWS,), 1.0, dtype=tl.float32)
    if NORM:
        rstd = _rows_rstd(x_ptr, res_ptr, eps, rm, live_m, stride_x, K, ADD, ROWS, BLOCK_K)
    if DEFER:  # static branches: [ROWS, BLOCK_N, BLOCK_K] products until the last block, else [ROWS, BLOCK_N] sums
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        live_k = rk < K
        mask = live_m[:, None] & live_k[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM:
            if ADD:
                x += tl.load(res_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
                if tl.program_id(0) == 0:
                    tl.store(res_out_ptr + rm[:, None] * K + rk[None, :], x.to(dtype), mask=mask)
            w_norm = tl.load(norm_ptr + rk, mask=live_k, other=0.0).to(tl.float32)
            x = (x * rstd[:, None] * w_norm[None, :]).to(dtype).to(tl.float32)
        w_mask = live_n[:, None] & live_k[None, :]
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if DEFER:
            acc += x[:, None, :] * w[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if GATED:
            w_up = tl.load(w_ptr + (N + rn)[:, None] * K + rk[None, :], mask=w_mask, other=0.0).to(tl.float32)
            if DEFER:
                acc_up += x[:, None, :] * w_up[None, :, :]
            else:
                acc_up += tl.sum(x[:, None, :] * w_up[None, :, :], axis=2)
    if DEFER:
        acc = tl.sum(acc, axis=2)
        acc_up = tl.sum(acc_up, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=live_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(dtype), mask=live_m[:, None] & live_n[None, :])
