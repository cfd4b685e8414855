"""Tensor-parallel process group: rank/size and the two collectives the layers need.

The all-reduce is the process group's (NCCL on GPUs, gloo on the CPU). MINISGL_TP_ALLREDUCE=symm_mem (opt-in,
one host) sends tensors up to 8 MB (a decode step's activations) through a buffer in PyTorch's symmetric memory
instead: one-shot, every GPU reads its peers' buffers over NVLink and sums (the copy into the buffer inside the same
kernel where this torch has it; a two-shot variant measured the same, session 17). Its kernels cannot be aborted:
with a peer dead they spin, and rank 0's watch then ends the process (distributed/launch.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("minisgl")
SYMM_MEM_MAX_BYTES = 8 * 2**20  # tensors up to this size take the symmetric-memory all-reduce


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP = TPInfo()


def set_tp_info(rank: int, size: int) -> None:
    global _TP
    _TP = TPInfo(rank, size)


def get_tp_info() -> TPInfo:
    return _TP


class SymmMemAllReduce:
    """One-shot all-reduce through a symmetric-memory buffer that every rank registered (CUDA only)."""

    def __init__(self, device: torch.device, max_bytes: int = SYMM_MEM_MAX_BYTES) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older torch, a no-op later
        if enable is not None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group)
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, self.group)  # collective: every rank at the same point
        self.copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)  # torch >= 2.8

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32)
                and nbytes <= self.buf.numel() and nbytes % 16 == 0)

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


def setup_symm_mem(device: torch.device) -> None:
    """After the process group exists, on every rank: the symmetric-memory all-reduce where it can run."""
    global _SYMM
    _SYMM = None
    choice = os.environ.get("MINISGL_TP_ALLREDUCE", "nccl")
    if choice not in ("nccl", "symm_mem"):
        raise ValueError(f"MINISGL_TP_ALLREDUCE must be nccl or symm_mem, got {choice!r}")
    if choice == "symm_mem" and device.type == "cuda":
        _SYMM = SymmMemAllReduce(device)
        logger.info("tensor-parallel all-reduce up to %d MB through symmetric memory", SYMM_MEM_MAX_BYTES >> 20)


def reset_symm_mem() -> None:
    global _SYMM
    _SYMM = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    if _SYMM is not None and _SYMM.fits(x):
        return _SYMM(x)
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    import torch.distributed as dist

    # One collective into one buffer [tp, ..., shard], then one copy into [..., tp * shard]: a list
    # all_gather gathers into a flat buffer, copies it out per rank and torch.cat copies it again.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gathered = x.new_empty((_TP.size * x.shape[0], *x.shape[1:]))  # gloo wants the ranks concatenated
    gather(gathered, x.contiguous())
    return gathered.view(_TP.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], _TP.size * x.shape[-1])
