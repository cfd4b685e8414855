"""Where an engine computes: the device and dtype a config names ("auto" picks), and the CPU threads it runs."""

from __future__ import annotations

import os

import torch

from minisgl.engine.threads import default_threads
from minisgl.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but no CUDA GPU is visible: use device='cpu'")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def set_threads(threads: int | None, device: torch.device) -> None:
    """torch's CPU threads: `threads`, else (on the CPU, OMP_NUM_THREADS unset) the physical cores."""
    if threads is None and device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        threads = default_threads()  # physical cores, not torch's count of logical CPUs
    if threads is not None:  # every computing process builds one Engine: the one place to set it
        torch.set_num_threads(threads)
