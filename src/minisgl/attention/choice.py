"""Which attention backends an engine runs, and the page size that goes with them.

The engine asks here after it loads the model: `page_size_for` (config.page_size, or the one the backend reads
fastest), `backend_names` (the (prefill, decode) names from "auto", "NAME" or "PREFILL,DECODE", refused with a
ConfigError where the AttentionTarget's device, dtype or head size cannot run them) and `make_backend` (the backend
built from the registry's factories). Nothing here imports a GPU-only package: FlashInfer is looked for, not imported.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from minisgl.attention.hybrid import HybridBackend
from minisgl.attention.xqa import xqa_supported
from minisgl.errors import ConfigError
from minisgl.layers.fused import FLASHINFER_HEAD_DIMS

if TYPE_CHECKING:
    from minisgl.config import EngineConfig

logger = logging.getLogger("minisgl")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def flashinfer_fits(head_dim: int) -> bool:
    """FlashInfer is installed and takes this model's head size ("auto" runs torch-native attention otherwise)."""
    return head_dim in FLASHINFER_HEAD_DIMS and _importable("flashinfer")


def page_size_for(config: EngineConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> int:
    """config.page_size, or when it is None ("auto"): 16 where FlashInfer (or XQA) attention runs on a CUDA GPU,
    1 elsewhere. On the throughput workload FlashInfer reads pages of 16 ~4% faster than single-token pages
    (one H100, docs/benchmarks.md), and 16 is vLLM's default block size; the radix cache then shares
    prefixes in whole pages of 16 tokens. CPU attention and FA3 prefill keep single-token pages."""
    if config.page_size is not None:
        return config.page_size
    name = config.attention_backend
    gpu = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    flashinfer = name in ("flashinfer", "xqa", "flashinfer,xqa") or (name == "auto" and flashinfer_fits(head_dim))
    return 16 if gpu and flashinfer else 1


class AttentionTarget(NamedTuple):
    """What an engine's attention runs on, as the backend choice reads it."""

    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # the KV cache's (fp8 or the model's)
    head_dim: int
    page_size: int


def auto_xqa(config: EngineConfig, backends: dict[str, Any], target: AttentionTarget) -> bool:
    """XQA decodes an fp8_e4m3 KV cache when "auto" is asked on a Hopper GPU whose page size it takes
    (attention/xqa.py: ~1.5x FlashInfer's fp8 decode reads there) unless disable_xqa keeps FlashInfer's decode."""
    return (
        "xqa" in backends
        and not config.disable_xqa
        and target.kv_dtype == torch.float8_e4m3fn
        and xqa_supported(target.device, target.page_size, target.head_dim)
    )


def backend_names(config: EngineConfig, backends: dict[str, Any], target: AttentionTarget) -> tuple[str, str]:
    """(prefill, decode) backend names from "auto", "NAME" or "PREFILL,DECODE"."""
    device, dtype, kv_dtype, head_dim, _ = target
    name = config.attention_backend
    if name == "auto":
        name = _auto_name(config, backends, target)
    if name == "xqa":  # a decode kernel: FlashInfer prefills
        name = "flashinfer,xqa"
    parts = [p.strip() for p in name.split(",")]
    if len(parts) not in (1, 2) or not all(parts):
        raise ConfigError(f"attention backend must be NAME or PREFILL,DECODE, got {name!r}")
    if parts[0] == "xqa":
        raise ConfigError("'xqa' is a decode kernel: name a prefill backend first, e.g. 'flashinfer,xqa'")
    for part in parts:
        if part not in backends:
            raise ConfigError(f"unknown attention backend {part!r}: available {sorted(backends)}")
        if part != "torch" and device.type != "cuda":
            raise ConfigError(f"attention backend {part!r} needs a CUDA GPU: use 'torch' on {device}")
        if part != "torch" and dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention backend {part!r} needs dtype bfloat16 or float16, got {dtype}")
        if part in ("flashinfer", "fa3") and head_dim not in FLASHINFER_HEAD_DIMS:
            raise ConfigError(
                f"attention backend {part!r} takes head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))}; "
                f"this model's is {head_dim}: use 'torch' (or 'auto')"
            )
    if kv_dtype != dtype and parts[0] == "fa3":
        raise ConfigError("an fp8 KV cache needs FlashInfer's FA2 prefill (attention_backend 'flashinfer'), not 'fa3'")
    return parts[0], parts[-1]


def _auto_name(config: EngineConfig, backends: dict[str, Any], target: AttentionTarget) -> str:
    """What "auto" runs: FlashInfer (with XQA's fp8 decode where it fits) on a GPU that takes it, else torch."""
    device, dtype, _, head_dim, _ = target
    gpu = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    name = "flashinfer" if gpu and "flashinfer" in backends and flashinfer_fits(head_dim) else "torch"
    if gpu and name == "torch" and not _importable("flashinfer"):
        logger.warning("flashinfer is not installed: torch-native attention (pip install minisgl[gpu])")
    elif gpu and name == "torch":
        logger.warning(
            "head_dim %d: FlashInfer's kernels take %s; torch-native attention, no CUDA graphs",
            head_dim,
            "/".join(map(str, FLASHINFER_HEAD_DIMS)),
        )
    if name == "flashinfer" and auto_xqa(config, backends, target):
        name = "flashinfer,xqa"
    # fp8 on Hopper, pages XQA does not take
    elif name == "flashinfer" and auto_xqa(config, backends, target._replace(page_size=16)):
        logger.info(
            "an fp8 KV cache with page_size 16 (32, 64, 128) decodes with XQA's fp8 kernel, "
            "~1.3x the throughput of FlashInfer's fp8 decode on this GPU (docs/benchmarks.md)"
        )
    return name


def make_backend(backends: dict[str, Any], names: tuple[str, str], *args: Any) -> Any:
    """The backend for (prefill, decode) names, a HybridBackend when they differ; args: (model_config, kv_pool,
    page_table, device), what every factory takes."""
    prefill, decode = names
    if prefill == decode:
        return backends[prefill](*args)
    return HybridBackend(backends[prefill](*args), backends[decode](*args))
