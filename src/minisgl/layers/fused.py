"""flashinfer's fused kernels (RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE) for CUDA tensors.

The layers call `fused_ops(x)` on their hot path: it returns the flashinfer module when x is a
CUDA fp16/bf16 tensor and flashinfer is installed, else None (the plain PyTorch code runs).
flashinfer is imported on first use, so CPU installs never need it.
"""

from __future__ import annotations

from typing import Any

import torch

_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_flashinfer: Any = None
_checked = False


def fused_ops(x: torch.Tensor) -> Any:
    global _flashinfer, _checked
    if not x.is_cuda or x.dtype not in _FUSED_DTYPES:
        return None
    if not _checked:
        _checked = True
        try:
            import flashinfer

            _flashinfer = flashinfer
        except ImportError:
            _flashinfer = None
    return _flashinfer
