"""RMSNorm with an optional fused residual add (computed in float32 like HF Llama)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import all_reduce, fused_reduce_norm
from minisgl.layers.fp8_gemm import Fp8Gemm, add_rmsnorm
from minisgl.layers.fused import fused_ops
from minisgl.layers.linear import copy_checked


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The mean's divisor and eps as float32 scalars: CPU ops take them without a conversion each call.
        self._size_eps = (torch.tensor(float(hidden_size)), torch.tensor(eps))
        # Set where an FP8 GEMM follows (layers/quantize.py): the residual form lets the next kernel launch at once,
        # and quantizes its output per row for quantizes_for, the FP8 GEMM it feeds, where that GEMM takes it.
        self.early_dependents = False
        self.quantizes_for: Fp8Gemm | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        copy_checked(param, loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and x.is_cpu:
            # HF's steps (the same bits as torch.rms_norm, whose CPU version converts its scalars each call), in place
            # on the small tensors: 12 us instead of 17 for a decode row of SmolLM2
            size, eps = self._size_eps
            scale = torch.sum(x * x, -1, keepdim=True).div_(size).add_(eps).rsqrt_()
            return (x * scale).mul_(self.weight)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual).

        On CUDA (flashinfer) the residual form works in place: x becomes the norm, residual the sum.
        x may also be [tokens, heads, head_dim] (per-head q/k norm).
        """
        fi = fused_ops(x)
        if fi is not None:
            if residual is None:
                return fi.norm.rmsnorm(x, self.weight, self.eps)
            if self.early_dependents and x.dim() == 2:
                add_rmsnorm(x, residual, self.weight, self.eps, self.quantizes_for)
            else:
                fi.norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def reduce_forward(self, partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(all_reduce(partial), residual) for a row-parallel layer's partial sums (its forward with
        reduce=False): one kernel for the reduction, the add and the norm where distributed.fused_reduce_norm runs."""
        fused = fused_reduce_norm(partial, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        return self(all_reduce(partial), residual)
