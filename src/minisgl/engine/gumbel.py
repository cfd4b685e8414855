"""Sampling inside the decode CUDA graphs: temperature draws and greedy argmax in two Triton kernels.

A draw from softmax(logits / T) is argmax_j(logits_j + T * g_j) with g_j independent Gumbel(0, 1) noise
(the Gumbel-max trick, scaled by T > 0, which does not move the argmax); T = 0 is the plain argmax. The
first kernel reads each row's logits once in their own dtype (bf16 at batch 256 on a 152k vocabulary:
78 MB, against the float32 division and the separate sampling kernel that read and write ~0.3 GB) and keeps
a running (max, first argmax) per program; each row is split over several programs so that every batch
size fills the GPU. The second kernel picks each row's winner among its programs and advances the step
counter.

Both run inside the decode graphs (engine/cuda_graph.py), so they cost the host nothing: a Triton launch
from Python costs more host time than it saves GPU time at small batches (an eager kernel measured exactly
that on one H100, docs/benchmarks.md). The noise is Philox-4x32 (Triton's), keyed by (seed + step, row, column): a step
counter on the GPU that the second kernel increments, so a replayed graph draws new numbers every step
without the host writing anything, and every TP rank (same seed, same replays) draws the same tokens.
Uniforms are u = (k + 0.5) / 2**23 (exact in float32, never 0 or 1), and -log2(u) is floored at 1e-7, so
the noise is finite for every draw; on the GPU both logarithms are the hardware's base-2 approximation (lg2.approx),
since the noise, not the read, bounds the kernel.

A row's temperature decides its mode: T > 0 draws, T = 0 takes the argmax, T < 0 leaves the row alone
(its output is not written). On Hopper and later both kernels launch with programmatic dependent launch
(layers/fused.py: pdl_args).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from minisgl.layers.fused import gdc, pdl_args

BLOCK = 1024  # logits per program per loop iteration: four Philox numbers for each of 256 lanes
TARGET_PROGRAMS = 2048  # ~16 per SM of an H100: enough loads in flight to stream the logits
SEED_BIT = 1 << 62  # always set: Triton then always passes the seed as int64 (one compiled kernel)


try:  # the kernels are defined at import (a jit function calls another through the module's globals)
    import triton
    import triton.language as tl
except ImportError:  # no Triton: usable() is False and the graphs keep to the logits
    triton = None

if triton is not None:
    gdc_wait, gdc_launch_dependents = gdc()  # called by the kernels when PDL (launched with it; layers/fused.py)

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        if FAST:  # the GPU's one-instruction approximation (relative error ~2**-22): the noise is compute-bound
            return tl.inline_asm_elementwise(
                "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        return tl.log2(x)

    @triton.jit
    def _block(
        src, stream, key, temp, off, V, best_v, best_i, NOISE: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr
    ):
        """The running per-lane (max, first argmax) updated with logits[off : off + BLOCK] (+ temp * Gumbel noise
        when NOISE). off is a multiple of BLOCK, so the Philox counters off // 4 + lane are this block's own within
        the row's (the row's vocabulary shard's) stream of counters."""
        Q: tl.constexpr = BLOCK // 4  # one Philox call gives four numbers: one for each quarter of a block
        lanes = tl.arange(0, Q)
        if NOISE:
            r0, r1, r2, r3 = tl.randint4x(key, (stream.to(tl.int64) << 32) + off // 4 + lanes)
        for j in tl.static_range(4):
            cols = off + j * Q + lanes
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            if NOISE:
                bits = r0 if j == 0 else (r1 if j == 1 else (r2 if j == 2 else r3))
                u = ((bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                # Gumbel = -ln(-ln u) = -ln(ln 2) - ln 2 * log2(-log2 u): the first term is the same for every
                # column, so the argmax of logits + T * Gumbel is that of logits - T * ln 2 * log2(e), e = -log2 u
                # (Exp(1) / ln 2; the floor keeps an approximate log near u = 1 finite)
                e = tl.maximum(-_log2(u, FAST), 1e-7)
                x = x - (temp * 0.6931471805599453) * _log2(e, FAST)
            take = x > best_v
            best_v = tl.where(take, x, best_v)
            best_i = tl.where(take, cols, best_i)
        return best_v, best_i

    # Batch-dependent ints are not specialised on: one compiled kernel serves every captured batch size.
    @triton.jit(do_not_specialize=["NBLK", "SPLITS", "SHARD", "COL0"])
    def gumbel_draw_kernel(
        logits_ptr,
        stride,
        temp_ptr,
        step_ptr,
        seed,
        best_val_ptr,
        best_idx_ptr,
        V,
        NBLK,
        SPLITS,
        SHARD,
        COL0,
        SHARDS: tl.constexpr,
        BLOCK: tl.constexpr,
        FAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # launched early: the logits are complete from here on
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        part = tl.program_id(1)
        temp = tl.load(temp_ptr + row)
        src = logits_ptr + row.to(tl.int64) * stride
        stream = row * SHARDS + SHARD  # a vocabulary shard's own noise (tensor parallelism: a rank's columns)
        Q: tl.constexpr = BLOCK // 4
        best_v = tl.full([Q], float("-inf"), tl.float32)
        best_i = tl.zeros([Q], dtype=tl.int32)
        start = part * NBLK * BLOCK
        # while, not range(NBLK): older Triton interpreters hand a kernel's int arguments over as 1-element arrays,
        # which range() cannot take (numpy 2 refuses int() of them) but a comparison can.
        k = 0
        if temp > 0:
            key = seed + tl.load(step_ptr)
            while k < NBLK:
                best_v, best_i = _block(src, stream, key, temp, start + k * BLOCK, V, best_v, best_i, True, BLOCK, FAST)
                k += 1
        elif temp == 0:
            while k < NBLK:
                best_v, best_i = _block(
                    src, stream, seed, temp, start + k * BLOCK, V, best_v, best_i, False, BLOCK, FAST
                )
                k += 1
        if temp >= 0:  # temp < 0: the row is sampled outside the graph
            v = tl.max(best_v, axis=0)
            tl.store(best_val_ptr + row * SPLITS + part, v)
            tl.store(best_idx_ptr + row * SPLITS + part, COL0 + tl.min(tl.where(best_v == v, best_i, V), axis=0))

    @triton.jit(do_not_specialize=["SPLITS", "STRIDE"])
    def gumbel_reduce_kernel(
        best_val_ptr,
        best_idx_ptr,
        temp_ptr,
        out_ptr,
        step_ptr,
        SPLITS,
        STRIDE,
        SHARDS: tl.constexpr,
        S: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        parts = tl.arange(0, S)  # every shard's programs of this row: [batch, splits] a shard, shards STRIDE apart
        live = parts < SPLITS * SHARDS
        at = (parts // SPLITS) * STRIDE + row * SPLITS + parts % SPLITS
        v = tl.load(best_val_ptr + at, mask=live, other=float("-inf"))
        i = tl.load(best_idx_ptr + at, mask=live, other=2147483647)
        first = tl.min(tl.where(v == tl.max(v, axis=0), i, 2147483647), axis=0)
        if tl.load(temp_ptr + row) >= 0:
            tl.store(out_ptr + row, first.to(tl.int64))
        if row == 0:  # every draw of this step has read the counter (the draw kernel ran before this one)
            tl.store(step_ptr, tl.load(step_ptr) + 1)


def _kernels() -> tuple[Any, Any] | None:
    """(draw kernel, reduce kernel); None when Triton is missing."""
    if triton is None:
        return None
    return gumbel_draw_kernel, gumbel_reduce_kernel


def usable(device: torch.device | str) -> bool:
    device = torch.device(device)
    return (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and _kernels() is not None


def splits_for(batch: int, vocab: int) -> int:
    """Programs per row: enough programs overall, each over at least one block."""
    return max(1, min(-(-TARGET_PROGRAMS // batch), -(-vocab // BLOCK)))


class Workspace:
    """The buffers of sample_into for batches of up to max_bs rows (static: a CUDA graph reads and writes them).

    Under tensor parallelism (shards > 1) each rank samples its own vocabulary shard (vocab: the shards' width, the
    last one's logits may be narrower; col0: its first column's id; shard: its index) and gather(out, local)
    all-gathers the ranks' per-program winners (an
    all_gather_into_tensor over the ranks, in shard order) before the reduce: a few KB instead of the logits.
    """

    def __init__(
        self,
        max_bs: int,
        vocab: int,
        device: torch.device | str,
        seed: int = 0,
        max_splits: int | None = None,
        shards: int = 1,
        shard: int = 0,
        col0: int = 0,
        gather: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> None:
        assert shards == 1 or gather is not None, "a sharded vocabulary needs the ranks' gather"
        self.vocab = vocab
        self.seed = SEED_BIT | (seed & (SEED_BIT - 1))
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        cells = max(b * (max_splits or splits_for(b, vocab)) for b in range(1, max_bs + 1))
        self.max_splits = max_splits or splits_for(1, vocab)  # the reduce kernel's width: one for every batch size
        self.shards, self.shard, self.col0, self.gather = shards, shard, col0, gather
        if shards == 1:
            self.best_val = torch.empty(cells, dtype=torch.float32, device=device)
            self.best_idx = torch.empty(cells, dtype=torch.int32, device=device)
        else:  # one buffer to gather: a call's n winners' values (float32 bits), then their ids
            self.packed = torch.empty(2 * cells, dtype=torch.int32, device=device)
            self.gathered = torch.empty(shards * 2 * cells, dtype=torch.int32, device=device)


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def sample_into(
    logits: torch.Tensor, temperature: torch.Tensor, out: torch.Tensor, ws: Workspace, splits: int | None = None
) -> None:
    """out[r] = a draw from softmax(logits[r] / temperature[r]) (temperature > 0), argmax (= 0), untouched (< 0).

    logits [B, V] of any float dtype (rows contiguous), temperature [B] float32, out [B] int64; two kernel
    launches and no host sync, so it can be captured in a CUDA graph. Each call advances ws.step on the device.
    With a sharded workspace logits are this rank's columns and every rank gets the same ids (ws.gather between).
    """
    kernels = _kernels()
    assert kernels is not None, "check usable() first"
    draw, reduce = kernels
    batch, vocab = logits.shape
    splits = splits or splits_for(batch, ws.vocab)  # the same on every rank, whatever its shard's width
    n = batch * splits
    assert logits.stride(-1) == 1 and vocab <= ws.vocab
    if ws.shards == 1:
        assert n <= len(ws.best_val)
        best_val, best_idx = ws.best_val[:n], ws.best_idx[:n]
    else:
        assert 2 * n <= len(ws.packed)
        best_val, best_idx = ws.packed[:n].view(torch.float32), ws.packed[n : 2 * n]
    block = min(BLOCK, max(4, 1 << max(0, vocab - 1).bit_length()))  # a small vocabulary: a block of its size
    blocks = -(-(-(-vocab // splits)) // block)  # blocks per program
    launch = pdl_args(logits.device)
    draw[(batch, splits)](
        logits,
        logits.stride(0),
        temperature,
        ws.step,
        ws.seed,
        best_val,
        best_idx,
        vocab,
        blocks,
        splits,
        ws.shard,
        ws.col0,
        SHARDS=ws.shards,
        BLOCK=block,
        FAST=logits.is_cuda,
        num_warps=4,
        **launch,  # FAST: the interpreter has no PTX
    )
    stride = n  # between two shards' winners
    if ws.shards > 1:
        gathered = ws.gathered[: ws.shards * 2 * n]
        ws.gather(gathered, ws.packed[: 2 * n])
        best_val, best_idx, stride = gathered.view(torch.float32), gathered[n:], 2 * n
    reduce[(batch,)](
        best_val,
        best_idx,
        temperature,
        out,
        ws.step,
        splits,
        stride,
        SHARDS=ws.shards,
        S=_pow2(max(splits, ws.max_splits) * ws.shards),
        **launch,
    )


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, ws: Workspace | None = None, splits: int | None = None
) -> torch.Tensor:
    """Token ids [B] (int64) from softmax(logits / temperature) (argmax where it is 0): sample_into, buffers made
    here."""
    batch, vocab = logits.shape
    ws = ws or Workspace(batch, vocab, logits.device, max_splits=splits)
    out = torch.full((batch,), -1, dtype=torch.int64, device=logits.device)
    sample_into(logits.contiguous(), temperature.reshape(-1).float().contiguous(), out, ws, splits)
    return out
