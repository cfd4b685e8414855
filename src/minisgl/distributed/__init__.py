"""Tensor-parallel process group: rank/size and the two collectives the layers need.

The all-reduce is the process group's (NCCL on GPUs, gloo on the CPU) with tp_allreduce="nccl", on several hosts
and on the CPU. tp_allreduce="symm_mem" (one host) sends tensors up to 8 MB (a decode step's activations) through a
buffer in PyTorch's symmetric memory instead: one-shot, every GPU reads its peers' buffers over NVLink and sums (the
copy into the buffer inside the same kernel where this torch has it; a two-shot variant measured the same on 2x H200).
Its kernels cannot be aborted: with a peer dead they spin, and rank 0's watch then ends the process
(runtime/ranks.py).

tp_allreduce="fused" goes further for the all-reduces that a residual RMSNorm follows (every row-parallel projection
of a decoder): the projection writes its partial sums into symmetric memory and one kernel per rank sums the ranks'
rows, adds the residual and normalizes (distributed/reduce_norm.py). tp_allreduce="fused_ll" (the default; one CUDA
host) is the same without the kernel's barrier: each rank stores its rows into its peers' memory and waits on its
own until theirs have arrived (on 2x H200 4.4 against 6.0 us at one row, 12.4 against 13.7 at 256: 1.02x the
throughput on the Qwen3-30B-A3B shape and 7% faster at batch 1; dense 14B within 0.5%). The layers ask
for it with `RowParallelLinear(x, reduce=False)` and `RMSNorm.reduce_forward` (and a MoE layer's experts write
their sum there too); other all-reduces take NCCL's. On 2x H200 it gave 1.07x NCCL's throughput (Qwen3-14B shape)
and passed the parity and killed-rank checks; a dead rank is reported within about a second either way (rank 0's step
stuck in such a kernel ends its process after SYMM_STUCK_EXIT_S, runtime/ranks.py).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minisgl.distributed.reduce_norm import SymmReduceNorm

logger = logging.getLogger("minisgl")
SYMM_MEM_MAX_BYTES = 8 * 2**20  # tensors up to this size take the symmetric-memory all-reduce


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    moe_parallel: str = "auto"  # how MoE layers lay out their experts over the ranks (EngineConfig.moe_parallel)

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP = TPInfo()


def set_tp_info(rank: int, size: int, moe_parallel: str = "auto") -> None:
    global _TP
    _TP = TPInfo(rank, size, moe_parallel)


def get_tp_info() -> TPInfo:
    return _TP


def symm_mem_group() -> str:
    """The TP group's name, with symmetric memory enabled for it (older torch needs that; a no-op later)."""
    import torch.distributed._symmetric_memory as symm_mem  # private torch API, CUDA only: where it is used

    group = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group)
    return group


class SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer that every rank registered (CUDA only)."""

    def __init__(self, device: torch.device, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem  # private torch API, CUDA only: where it is used

        self.group = symm_mem_group()
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, self.group)  # collective: every rank at the same point
        self.copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)  # torch >= 2.8

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.is_cuda
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float32)
            and nbytes <= self.buf.numel()
            and nbytes % 16 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        slot = self.buf.view(x.dtype)[: flat.numel()]
        if self.copy_out is not None:  # one kernel: x into the buffer, the ranks' barrier, the sum into a new tensor
            out = torch.empty_like(flat)  # not x: another block of this rank may still be copying it in
            self.copy_out(slot, flat, "sum", self.group, out)
            return out.view_as(x)
        slot.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.group, flat)
        return x


_SYMM: SymmMemAllReduce | None = None
_REDUCE_NORM: Any = None  # reduce_norm.SymmReduceNorm where tp_allreduce="fused" or "fused_ll"


def setup_symm_mem(device: torch.device, choice: str, fused_mb: int) -> None:
    """After the process group exists, on every rank: the symmetric-memory all-reduce where it can run.

    choice and fused_mb: EngineConfig.tp_allreduce ("nccl", "symm_mem", "fused" or "fused_ll") and tp_fused_mb."""
    global _SYMM, _REDUCE_NORM
    _SYMM = _REDUCE_NORM = None
    if choice == "symm_mem" and device.type == "cuda":
        _SYMM = SymmMemAllReduce(device)
        logger.info("tensor-parallel all-reduce up to %d MB through symmetric memory", SYMM_MEM_MAX_BYTES >> 20)
    elif choice in ("fused", "fused_ll") and device.type == "cuda":
        # Each of its two slots holds one reduction: 8 MB takes decode's (batch 256 x 5,120 x bf16: 2.6 MB);
        # tp_fused_mb=192 takes a 16k-token prefill chunk's too (bigger slots: less memory for the KV).
        low_latency = choice == "fused_ll"
        _REDUCE_NORM = SymmReduceNorm(device, symm_mem_group(), _TP.rank, _TP.size, fused_mb << 20, low_latency)
        logger.info(
            "tensor-parallel all-reduce + residual + RMSNorm fused, up to %d MB, through symmetric memory", fused_mb
        )


def reset_symm_mem() -> None:
    global _SYMM, _REDUCE_NORM
    _SYMM = _REDUCE_NORM = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    if _SYMM is not None and _SYMM.fits(x):
        return _SYMM(x)

    dist.all_reduce(x)
    return x


def partial_out(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Where a row-parallel projection's [rows, cols] partial sums go when the next norm reduces them in its kernel
    (tp_allreduce="fused" or "fused_ll", and they fit); None: a plain tensor, reduced by all_reduce."""
    return _REDUCE_NORM.partial_out(rows, cols, dtype) if _REDUCE_NORM is not None else None


def fused_reduce_norm(
    partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(all_reduce(partial) + residual), the sum, in residual) in one kernel where partial came from
    partial_out; None otherwise."""
    if _REDUCE_NORM is None or not _REDUCE_NORM.owns(partial):
        return None
    return _REDUCE_NORM(partial, residual, weight, eps)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x

    # One collective into one buffer [tp, ..., shard], then one copy into [..., tp * shard]: a list
    # all_gather gathers into a flat buffer, copies it out per rank and torch.cat copies it again.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gathered = x.new_empty((_TP.size * x.shape[0], *x.shape[1:]))  # gloo wants the ranks concatenated
    gather(gathered, x.contiguous())
    return gathered.view(_TP.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], _TP.size * x.shape[-1])


def min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest n over the TP ranks (e.g. a KV pool size every rank must schedule on: free memory differs a
    little between them)."""
    if get_tp_info().size == 1 or not dist.is_initialized():
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
