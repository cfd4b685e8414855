"""Temperature sampling in one pass over the logits, in their own dtype (Triton, CUDA only).

A draw from softmax(logits / T) is argmax_j(logits_j / T + g_j) with g_j independent Gumbel(0, 1)
noise (the Gumbel-max trick). The kernel reads each row's logits once (bf16 at batch 256 on a
152k vocabulary: 78 MB instead of the 0.5 GB that a float32 cast, a division by T and a separate
sampling kernel move), draws the noise from Philox counters in registers (one call, four numbers,
for four columns), and keeps a running (max, argmax); each row is split over several programs so that small batches fill the
GPU, and the programs' winners are reduced by two small torch ops.

The noise comes from 23-bit uniforms u = (k + 0.5) / 2**23 (exact in float32, never 0 or 1) and
-log(u) is floored at 1e-7, so -log(-log(u)) is finite for every draw: a uniform that rounded to 1
would give its token infinite weight, whatever its logit. The seed of a call is drawn
by the caller from its own stream: the same seeds give the same tokens, on every TP rank.

Used by engine.sampler for rows that need only a temperature (no top-k/top-p/min-p, no seeded
generator, no penalties or grammar masks); MINISGL_FUSED_SAMPLING=0 turns it off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

BLOCK = 1024
TARGET_PROGRAMS = 264  # two per SM of an H100: enough programs in flight to stream the logits


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; None when Triton is missing or the switch is off."""
    if os.environ.get("MINISGL_FUSED_SAMPLING", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gumbel_max_kernel(
        logits_ptr, stride, inv_temp_ptr, seed, best_val_ptr, best_idx_ptr, V, CHUNK, SPLITS, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        src = logits_ptr + row.to(tl.int64) * stride
        Q: tl.constexpr = BLOCK // 4  # one Philox call gives four numbers: one for each quarter of a block
        lanes = tl.arange(0, Q)
        best_v = tl.full([Q], float("-inf"), tl.float32)
        best_i = tl.zeros([Q], dtype=tl.int32)
        for k in range(0, CHUNK, BLOCK):
            off = part * CHUNK + k  # a multiple of BLOCK: the counters off // 4 + lane are this block's own
            r0, r1, r2, r3 = tl.randint4x(seed + row, off // 4 + lanes)
            for j in tl.static_range(4):
                bits = r0 if j == 0 else (r1 if j == 1 else (r2 if j == 2 else r3))
                cols = off + j * Q + lanes
                x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                u = ((bits.to(tl.uint32, bitcast=True) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # (0, 1)
                e = tl.maximum(-tl.log(u), 1e-7)  # Exp(1); the floor keeps an approximate log near u = 1 finite
                g = x * inv_t - tl.log(e)
                take = g > best_v
                best_v = tl.where(take, g, best_v)
                best_i = tl.where(take, cols, best_i)
        v = tl.max(best_v, axis=0)
        i = tl.min(tl.where(best_v == v, best_i, V), axis=0)  # the first column of the winning value
        tl.store(best_val_ptr + row * SPLITS + part, v)
        tl.store(best_idx_ptr + row * SPLITS + part, i)

    return gumbel_max_kernel


def usable(logits: torch.Tensor) -> bool:
    return (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and logits.dim() == 2 and _kernel() is not None


def splits_for(batch: int, vocab: int) -> int:
    """Programs per row: enough programs overall, each over at least one block."""
    return max(1, min(-(-TARGET_PROGRAMS // batch), -(-vocab // BLOCK)))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, splits: int | None = None) -> torch.Tensor:
    """Token ids [B] (int64) drawn from softmax(logits / temperature), logits [B, V] of any float dtype,
    temperature [B] or [B, 1] float32 (> 0). seed: a 62-bit int; equal seeds give equal draws.
    splits: programs per row (default splits_for(B, V))."""
    kernel = _kernel()
    assert kernel is not None, "check usable() first"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    splits = splits or splits_for(batch, vocab)
    chunk = -(-vocab // splits)
    inv_temp = (1.0 / temperature.reshape(-1).float()).contiguous()
    best_val = torch.empty(batch, splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, splits, dtype=torch.int32, device=logits.device)
    block = min(BLOCK, max(4, 1 << max(0, vocab - 1).bit_length()))  # a small vocabulary: a block of its size
    chunk = -(-chunk // block) * block
    # Runtime ints (not constexpr): a batch size of its own must not compile a kernel of its own. The seed
    # always has bit 62 set, so Triton always passes it as int64 (a value below 2**31 would compile an int32 twin).
    kernel[(batch, splits)](
        logits, logits.stride(0), inv_temp, (1 << 62) | (seed & ((1 << 62) - 1)), best_val, best_idx, vocab, chunk,
        splits, BLOCK=block, num_warps=4,
    )
    winner = best_val.argmax(dim=1, keepdim=True)
    return best_idx.gather(1, winner).squeeze(1).to(torch.int64)
