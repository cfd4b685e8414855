"""flashinfer's fused kernels (RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE) for CUDA tensors.

The layers call `fused_ops(x)` on their hot path: it returns the flashinfer module when x is a
CUDA fp16/bf16 tensor and flashinfer is installed, else None (the plain PyTorch code runs).
flashinfer is imported on first use, so CPU installs never need it.

`pdl_args(device)` are the launch keywords of minisgl's own Triton kernels (layers/fused_qkv.py, engine/gumbel.py):
with programmatic dependent launch where `pdl(device)`, as flashinfer launches its kernels on Hopper and later
(`gdc()`: Triton's controls).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_FUSED_DTYPES = (torch.float16, torch.bfloat16)
# Head sizes flashinfer's attention and RoPE kernels are built for. Its RoPE refuses any other ("Unsupported
# head_dim"); its FA2 prefill JIT-builds any size without a check, then fails (32: "Invalid configuration") or reads
# out of bounds and gives wrong results silently (sizes not a multiple of 64: flashinfer-ai/flashinfer#4299).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
_flashinfer: Any = None
_checked = False


def fused_ops(x: torch.Tensor) -> Any:
    global _flashinfer, _checked
    if not x.is_cuda or x.dtype not in _FUSED_DTYPES:
        return None
    if not _checked:
        _checked = True
        try:
            import flashinfer  # lazy: flashinfer is GPU-only

            _flashinfer = flashinfer
        except ImportError:
            _flashinfer = None
    return _flashinfer


def gdc() -> tuple[Any, Any]:
    """Triton's grid-dependency controls (gdc_wait, gdc_launch_dependents), Triton >= 3.4; (None, None) without them."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # lazy: triton is GPU-only
    except ImportError:
        return None, None
    return gdc_wait, gdc_launch_dependents


@functools.cache
def pdl(device: torch.device) -> bool:
    """Launch Triton kernels on this device with programmatic dependent launch: a CUDA device of compute capability
    9 or later and Triton with the controls. Such a kernel calls gdc_wait() before its first
    load or store (the previous kernel's writes are complete and visible after it) and gdc_launch_dependents() right
    after, so its own launch and the next kernel's overlap the kernels before them."""
    if device.type != "cuda" or gdc()[0] is None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a Triton kernel with a `PDL: tl.constexpr` parameter: PDL and Triton's launch_pdl on
    where pdl(device), else PDL=False alone (a Triton without PDL takes no launch_pdl keyword)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}
