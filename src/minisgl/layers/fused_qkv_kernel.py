"""The Triton kernel behind layers/fused_qkv.py; imported on first use, and only where Triton imports."""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.layers.fused import gdc

gdc_wait, gdc_launch_dependents = gdc()


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
def qkv_kernel(
    qkv_ptr,
    qkv_stride,
    pos_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_stride,
    loc_ptr,
    T,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_MAX: tl.constexpr,
    TB: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (programmatic dependent launch): the previous kernel's output is complete from here on
        gdc_wait()
        gdc_launch_dependents()
    # one head (program_id 1) of TB tokens (program_id 0): rows of [TB, D // 2] halves
    t = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
    live = t < T
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, half)[None, :]
    mask = live[:, None]
    src = qkv_ptr + t[:, None] * qkv_stride + h * D + offs
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    loc = tl.load(loc_ptr + t, mask=live, other=0).to(tl.int64)[:, None]
    if h >= H + HKV:  # v: copied to its slot
        if KV_MAX > 0:  # an fp8 pool: saturated to its range, as KVPool.store does
            x1 = tl.minimum(tl.maximum(x1, -KV_MAX), KV_MAX)
            x2 = tl.minimum(tl.maximum(x2, -KV_MAX), KV_MAX)
        v_dst = v_cache_ptr + loc * cache_stride + (h - H - HKV) * D + offs
        tl.store(v_dst, x1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + half, x2.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            if h < H:
                w1 = tl.load(q_norm_ptr + offs).to(tl.float32)
                w2 = tl.load(q_norm_ptr + half + offs).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + offs).to(tl.float32)
                w2 = tl.load(k_norm_ptr + half + offs).to(tl.float32)
            x1 = x1 * rstd * w1
            x2 = x2 * rstd * w2
        pos = tl.load(pos_ptr + t, mask=live, other=0).to(tl.int64)[:, None]
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs, mask=mask, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + half + offs, mask=mask, other=0.0)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        # One name per pointer type: Triton's compiler rejects a variable that is bf16* in one branch and
        # fp8* in the other (the interpreter does not check, so only a GPU compile catches it).
        if h < H:
            q_dst = q_out_ptr + (t[:, None] * H + h) * D + offs
            tl.store(q_dst, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
            tl.store(q_dst + half, o2.to(q_out_ptr.dtype.element_ty), mask=mask)
        else:
            if KV_MAX > 0:
                o1 = tl.minimum(tl.maximum(o1, -KV_MAX), KV_MAX)
                o2 = tl.minimum(tl.maximum(o2, -KV_MAX), KV_MAX)
            k_dst = k_cache_ptr + loc * cache_stride + (h - H) * D + offs
            tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_dst + half, o2.to(k_cache_ptr.dtype.element_ty), mask=mask)
