"""The Triton kernels behind distributed/reduce_norm.py (the protocols are described there); imported on first use,
and only where Triton imports."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_norm_store(acc, residual_ptr, w, out_ptr, offs, mask, eps, H: tl.constexpr):
    """The all-reduced row (float32 sums, rounded as NCCL returns them) + the residual (written back), normed."""
    dtype = out_ptr.dtype.element_ty
    x = acc.to(dtype).to(tl.float32) + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(residual_ptr + offs, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + offs, (x * rstd * w).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["M", "rank"])
def reduce_norm_kernel(
    bufs_ptr,
    flags_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    M,
    rank,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    if WORLD > 1:  # this program's barrier with the same program of every peer
        mine = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int32)) + pid * WORLD
        for p in range(WORLD):
            if p != rank:  # tell peer p that this rank's partial sums are ready (its flag for us: 0 -> 1)
                theirs = tl.load(flags_ptr + p).to(tl.pointer_type(tl.int32)) + pid * WORLD + rank
                while tl.atomic_cas(theirs, 0, 1, sem="release", scope="sys") != 0:
                    pass
        for p in range(WORLD):
            if p != rank:  # wait until peer p has told us (our flag for it: 1 -> 0)
                while tl.atomic_cas(mine + p, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, nprog):
        offs = row * H + cols  # < 2**31: a slot holds at most a few million elements
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in range(WORLD):
            # 16-byte aligned (reduce_add_rmsnorm), which Triton cannot see in an address loaded from memory:
            # without the hint it reads the partial sums 2 bytes at a time.
            part = tl.multiple_of(tl.load(bufs_ptr + p).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(part + offs, mask=mask, other=0.0).to(tl.float32)
        add_norm_store(acc, residual_ptr, w, out_ptr, offs, mask, eps, H)


@triton.jit(do_not_specialize=["M", "rank"])
def reduce_norm_ll_kernel(
    part_ptr,
    inbox_ptrs,
    residual_ptr,
    weight_ptr,
    out_ptr,
    M,
    rank,
    eps,
    seg,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    empty = tl.full([BLOCK], -32768, tl.int16).to(dtype, bitcast=True)  # -0.0 marks a cell not yet written
    for row in range(pid, M, nprog):  # this rank's rows, -0.0 made +0.0, into segment `rank` of every peer's inbox
        x = tl.load(part_ptr + row * H + cols, mask=mask, other=0.0)
        x = tl.where(x.to(tl.int16, bitcast=True) == -32768, 0.0, x).to(dtype)
        for p in range(WORLD):
            if p != rank:
                inbox = tl.multiple_of(tl.load(inbox_ptrs + p).to(tl.pointer_type(dtype)) + rank * seg, 16)
                tl.store(inbox + row * H + cols, x, mask=mask)
    mine = tl.multiple_of(tl.load(inbox_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, nprog):
        offs = row * H + cols  # < 2**31: a slot holds at most a few million elements
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in range(WORLD):  # the ranks in order, as NCCL sums them: every rank the same bits
            if p == rank:
                v = tl.load(part_ptr + offs, mask=mask, other=0.0)
                v = tl.where(v.to(tl.int16, bitcast=True) == -32768, 0.0, v).to(dtype)
            else:  # wait until every cell of peer p's row has arrived, then mark the row empty again
                cell = tl.multiple_of(mine + p * seg, 16) + offs
                v = tl.load(cell, mask=mask, other=0.0, volatile=True)
                while tl.sum(((v.to(tl.int16, bitcast=True) == -32768) & mask).to(tl.int32), axis=0) > 0:
                    v = tl.load(cell, mask=mask, other=0.0, volatile=True)
                tl.store(cell, empty, mask=mask)
            acc += v.to(tl.float32)
        add_norm_store(acc, residual_ptr, w, out_ptr, offs, mask, eps, H)
