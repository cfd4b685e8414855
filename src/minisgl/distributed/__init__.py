"""Tensor-parallel process group: rank/size and the two collectives the layers need."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
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
