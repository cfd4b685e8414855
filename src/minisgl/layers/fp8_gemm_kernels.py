"""The Triton kernels behind layers/fp8_gemm.py; imported on first use, and only where Triton imports.

Each takes PDL: launched with programmatic dependent launch (layers/fused.py), it waits for the kernels before it
with gdc_wait, after reading only what they do not write, and lets the next kernel launch at once. The weight-only
kernels also take GATE_UP: b is an MLP's [2N, K] gate_up weight (gate rows, then up rows) and c[m, n] is
silu(gate) * up, gate and up first rounded to c's dtype as the GEMM writes them and the product rounded as
SiLU-and-mul writes it: the activation needs no kernel of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.layers.fused import gdc

gdc_wait, gdc_launch_dependents = gdc()


@triton.jit
def silu_and_mul(gate, up, dtype: tl.constexpr):
    # silu(gate) * up in float32 from gate and up rounded to dtype, as the unfused GEMM and SiLU-and-mul compute it.
    gate = gate.to(dtype).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)


@triton.jit
def quant_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row: scale = max |x| / 448, then q = x / scale in e4m3 (saturating).
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k + offs, q.to(q_ptr.dtype.element_ty), mask=k + offs < K)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def w8a16_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm, GATE_UP: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # c[m, n] = scale[n] * sum_k a[m, k] * b[n, k], b widened from FP8 to a's dtype tile by tile.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]  # rows of b, contiguous along K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATE_UP:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
        acc += tl.dot(a, tl.trans(b.to(a.dtype)))
        if GATE_UP:
            b = tl.load(b_ptrs + N * stride_bn, mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_left), other=0.0)
            acc_up += tl.dot(a, tl.trans(b.to(a.dtype)))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if GATE_UP:
        up = acc_up * tl.load(scale_ptr + N + offs_n, mask=offs_n < N, other=0.0)[None, :]
        acc = silu_and_mul(acc, up, c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def w8a8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, scale_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm, GATE_UP: tl.constexpr,
    PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # c[m, n] = a_scale[m] * scale[n] * sum_k a[m, k] * b[n, k], a and b both e4m3 (FP8 tensor cores). Programs
    # with the same columns run next to each other (pid_m varies fastest), so a weight tile that several row blocks
    # need is read from memory once and then from L2. Hopper's FP8 MMA accumulates with fewer bits than float32,
    # and Triton lets it run over all of K there: the sum is moved into the float32 accumulator every 128 terms
    # (as DeepSeek-V3 and cuBLAS do), which keeps a 12,288-long row within bf16 rounding of torch._scaled_mm.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATE_UP:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k[None, :] < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask, other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=128)
        if GATE_UP:
            b = tl.load(b_ptrs + N * stride_bn, mask=n_mask[:, None] & k_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(b), acc_up, max_num_imprecise_acc=128)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    acc = acc * a_scale * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if GATE_UP:
        up = acc_up * a_scale * tl.load(scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
        acc = silu_and_mul(acc, up, c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def gemv_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
    ROWS: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # c[m, n] = scale[n] * sum_k a[m, k] * b[n, k] for the ROWS rows of a, on the CUDA cores: a program streams
    # BLOCK_N rows of b (contiguous along K) once per row of a (the second pass hits L2).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    # The weights are no kernel's output: the first tile is read while the kernels before finish (PDL).
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    b_first = tl.load(b_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    if GATE_UP:
        up_ptrs = b_ptrs + N * stride_bn
        up_scale = tl.load(scale_ptr + N + offs_n, mask=n_mask, other=0.0)
        up_first = tl.load(up_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for m in tl.static_range(ROWS):
        a_row = a_ptr + m * stride_am
        a = tl.load(a_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        acc = b_first.to(tl.float32) * a[None, :]
        if GATE_UP:
            acc_up = up_first.to(tl.float32) * a[None, :]
        for k in range(BLOCK_K, K, BLOCK_K):
            k_mask = k + offs_k < K
            a = tl.load(a_row + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += b * a[None, :]
            if GATE_UP:
                b = tl.load(up_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc_up += b * a[None, :]
        y = tl.sum(acc, axis=1) * scale
        if GATE_UP:
            y = silu_and_mul(y, tl.sum(acc_up, axis=1) * up_scale, c_ptr.dtype.element_ty)
        tl.store(c_ptr + m * stride_cm + offs_n, y.to(c_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, H, eps, stride_x, stride_r, stride_q, FP8_MAX: tl.constexpr,
    QUANT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One row: res <- x + res, x <- (x + res) * rsqrt(mean((x + res)^2) + eps) * w, in float32 from the unrounded
    # sum (flashinfer's fused_add_rmsnorm). It lets the next kernel launch before it computes (flashinfer's norm: at
    # its end), so the FP8 GEMM after it reads its first weight tiles meanwhile; EARLY (the one-row GEMV next): even
    # before it waits for the kernel before it. QUANT: also the rounded output quantized per row for the FP8 x FP8
    # GEMM after it, as quant_rows_kernel would (q, scale).
    if PDL and EARLY:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        if not EARLY:
            gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * stride_r + offs, s.to(res_ptr.dtype.element_ty), mask=mask)
    rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    y = (s * rms * w).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + offs, y, mask=mask)
    if QUANT:
        y = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / FP8_MAX
        tl.store(scale_ptr + row, scale)
        q = tl.clamp(y / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
