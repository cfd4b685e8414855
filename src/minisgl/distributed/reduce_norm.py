"""All-reduce + residual add + RMSNorm in one kernel, through symmetric memory (Triton, CUDA, one host).

A tensor-parallel decoder sums each row-parallel projection's partial outputs across ranks and then, in the next
kernel, adds the residual and normalizes. Here the projection writes its partial sums straight into a buffer in
PyTorch's symmetric memory (every rank maps every other rank's buffer), and one kernel per rank does the rest:
each program meets the same program of every peer at a barrier, then for its rows reads every rank's partial
sums over NVLink, adds them in float32 and rounds the sum to the model's dtype (what a two-rank NCCL all-reduce
returns), adds the residual (written back in place), normalizes and writes the output: flashinfer's
fused_add_rmsnorm arithmetic on the all-reduced rows. One kernel replaces NCCL's all-reduce and the norm, and no
copy into or out of a communication buffer is needed.

Two buffers, used in turn: the kernel never writes a peer's memory, only reads it, so a rank may overwrite its
slot only once every peer has finished reading it. A rank fills slot A again two reductions later, after its
own kernel for the reduction between (on slot B) passed that reduction's barrier, which every peer reaches only
after its kernel on slot A has finished (kernels of one stream run in order). So one barrier per reduction,
and no second one after the reads. Each (program, peer) barrier flag goes 0 -> 1 (the peer arrived) -> 0 (seen),
so CUDA graph replays need no counters; all ranks run the same sequence of forwards with the same row counts.

The low-latency variant (reduce_add_rmsnorm_ll) has no barrier: each rank first stores its rows into segment `rank`
of every peer's inbox (NVLink stores, which need no round trip), then waits on its own inbox, cell by cell, until the
peers' rows are there. The data is its own flag: an empty cell holds -0.0, which a sender never sends (it sends
+0.0, the same sum), and the reader marks the cells empty again once it has read them. An inbox is written again two
reductions later (the two slots), by a peer that has by then received this rank's rows of the reduction between,
which this rank sent only after its kernel that emptied the inbox had finished. One NVLink crossing per reduction
instead of three (arrive, see the peer's arrival, read): on 2x H200 4.4 against 6.0 us at one row.

Their spin-waits cannot be aborted: with a peer dead they spin, and rank 0's watch ends the process (runtime/ranks.py).
EngineConfig(tp_allreduce="fused" or "fused_ll") turns them on (distributed/__init__.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

MAX_PROGRAMS = 512  # programs of one launch (the barrier flags: MAX_PROGRAMS x world per slot)
_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _kernels() -> Any:
    """(the barrier kernel, the low-latency kernel), compiled on first use; None without Triton."""
    try:
        from minisgl.distributed import reduce_norm_kernel as k  # lazy: the kernels' module imports triton (GPU-only)
    except ImportError:
        return None
    return k.reduce_norm_kernel, k.reduce_norm_ll_kernel


def _launch(kernel: Any, rows: int, programs: int | None, hidden: int, world: int, *args: Any) -> None:
    """A program a row (up to MAX_PROGRAMS), 8 warps from 8,192 columns: on an H100 with one rank, 256 rows x 5,120
    took 3.6 µs so, 4.1-7.2 µs with 64 or 132 programs or 4, 16 or 32 warps (flashinfer's norm alone: 3.1 µs)."""
    grid = min(rows, programs or MAX_PROGRAMS, MAX_PROGRAMS)
    block = 1 << (hidden - 1).bit_length()
    kernel[(grid,)](*args, H=hidden, BLOCK=block, WORLD=world, num_warps=8 if block >= 8192 else 4)


def reduce_add_rmsnorm_ll(
    part: torch.Tensor,
    inboxes: torch.Tensor,
    seg: int,
    rank: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    programs: int | None = None,
) -> torch.Tensor:
    """reduce_add_rmsnorm without the barrier: each rank stores its partial sums (part: [rows, hidden], local) into
    its peers' inboxes, and each waits on its own inbox's cells until they hold data (-0.0 marks an empty cell: the
    senders send -0.0 as +0.0, the same sum), then marks them empty again.

    inboxes: int64 [world] on the device, the address of each rank's inbox: world segments of seg elements
    (segment r: rank r's rows), 16-byte aligned, every cell -0.0 at the start. Every rank calls it with the same
    rows and programs, and uses an inbox again only two reductions later (SymmReduceNorm's two slots)."""
    rows, hidden = part.shape
    assert residual.is_contiguous() and part.is_contiguous() and residual.dtype in _DTYPES
    assert residual.shape == part.shape
    out = torch.empty_like(residual)
    if rows:
        kernel = _kernels()[1]
        _launch(
            kernel, rows, programs, hidden, inboxes.numel(), part, inboxes, residual, weight, out, rows, rank, eps, seg
        )
    return out


def reduce_add_rmsnorm(
    bufs: torch.Tensor,
    flags: torch.Tensor,
    rank: int,
    rows: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    programs: int | None = None,
) -> torch.Tensor:
    """norm(sum of every rank's partial sums + residual), with the residual updated in place to that sum.

    bufs: int64 [world] on the device, the address of each rank's partial sums ([rows, hidden], contiguous,
    residual's dtype, 16-byte aligned); flags: int64 [world], the address of each rank's barrier flags (int32,
    MAX_PROGRAMS x world, zero at the start); rank: this rank's index. Every rank calls it with the same rows and
    programs.
    """
    world, hidden = bufs.numel(), residual.shape[-1]
    assert residual.is_contiguous() and residual.dtype in _DTYPES and residual.shape[0] == rows
    out = torch.empty_like(residual)
    if rows:
        _launch(_kernels()[0], rows, programs, hidden, world, bufs, flags, residual, weight, out, rows, rank, eps)
    return out


class SymmReduceNorm:
    """The two slots in symmetric memory, their addresses and barrier flags, and the call (CUDA only).

    low_latency: reduce_add_rmsnorm_ll instead, each slot followed by its inbox (world segments of a slot's size)."""

    def __init__(
        self, device: torch.device, group: Any, rank: int, world: int, slot_bytes: int, low_latency: bool = False
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem  # private torch API, CUDA only: where it is used

        assert slot_bytes % 16 == 0, "the kernel reads the slots 16 bytes at a time"
        self.rank, self.slot_bytes, self.low_latency = rank, slot_bytes, low_latency
        self.flag_bytes = MAX_PROGRAMS * world * 4
        data = slot_bytes * (1 + world) if low_latency else slot_bytes
        stride = data + self.flag_bytes
        self.mem = symm_mem.empty(2 * stride, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.mem, group)  # collective: every rank at the same point
        for k in range(2):
            self.mem[k * stride + data : (k + 1) * stride].zero_()
            if low_latency:  # every inbox cell empty (-0.0)
                self.mem[k * stride + slot_bytes : k * stride + data].view(torch.int16).fill_(-32768)
        torch.cuda.synchronize(device)
        dist.barrier()  # no rank signals a peer (or stores into its inbox) before the peer's flags are zero (empty)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        self.bufs = [torch.tensor([p + k * stride for p in ptrs], dtype=torch.int64, device=device) for k in range(2)]
        self.flags = [
            torch.tensor([p + k * stride + data for p in ptrs], dtype=torch.int64, device=device) for k in range(2)
        ]
        self.inboxes = [
            torch.tensor([p + k * stride + slot_bytes for p in ptrs], dtype=torch.int64, device=device)
            for k in range(2)
        ]
        self.slots = [self.mem[k * stride : k * stride + slot_bytes] for k in range(2)]
        self.next = 0

    def partial_out(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The next slot as a [rows, cols] tensor for a row-parallel projection's partial sums, or None where
        they do not fit (they then take the plain all-reduce). Each one must go to __call__ before the next."""
        if dtype not in _DTYPES or rows * cols * 2 > self.slot_bytes or _kernels() is None:
            return None
        k, self.next = self.next, self.next ^ 1
        return self.slots[k][: rows * cols * 2].view(dtype).view(rows, cols)

    def owns(self, x: torch.Tensor) -> bool:
        return x.data_ptr() in (self.slots[0].data_ptr(), self.slots[1].data_ptr())

    def __call__(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        programs: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = 0 if partial.data_ptr() == self.slots[0].data_ptr() else 1
        if self.low_latency:
            seg = self.slot_bytes // partial.element_size()
            out = reduce_add_rmsnorm_ll(partial, self.inboxes[k], seg, self.rank, residual, weight, eps, programs)
            return out, residual
        out = reduce_add_rmsnorm(
            self.bufs[k], self.flags[k], self.rank, partial.shape[0], residual, weight, eps, programs
        )
        return out, residual
