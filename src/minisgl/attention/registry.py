"""The attention backend registry: a backend name (as given to ``--attention-backend``) -> its factory.

A factory is called as ``factory(model_config, kv_pool, page_table, device)`` and returns an
AttentionBackend. The registry holds the built-ins below; the plugin loader (minisgl.plugins, above this
package) adds what the minisgl_register_attention_backends hook returns. Each built-in factory imports its
backend when called, so listing the backends never pulls in GPU-only packages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from minisgl.attention.base import AttentionBackend
    from minisgl.kvcache.pool import KVPool
    from minisgl.models.config import ModelConfig

BackendFactory = Callable[..., "AttentionBackend"]


def _torch_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    from minisgl.attention.torch_native import TorchNativeBackend  # lazy: listing the backends loads none

    return TorchNativeBackend(model_config, kv_pool, page_table, device)


def _flashinfer_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    from minisgl.attention.flashinfer import FlashInferBackend  # lazy: listing the backends loads none

    return FlashInferBackend(model_config, kv_pool, page_table, device, prefill_backend="fa2")


def _fa3_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    # FlashAttention-3 prefill (Hopper) through flashinfer; decode stays on flashinfer's tensor-core kernel.
    from minisgl.attention.flashinfer import FlashInferBackend  # lazy: listing the backends loads none

    return FlashInferBackend(model_config, kv_pool, page_table, device, prefill_backend="fa3")


def _xqa_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    # TensorRT-LLM's XQA decode kernel through flashinfer (decode only: the engine pairs it with a prefill backend).
    from minisgl.attention.xqa import XqaBackend  # lazy: listing the backends loads none

    return XqaBackend(model_config, kv_pool, page_table, device)


# The built-in backends: adding one is one line here (and its factory above).
BUILTIN_BACKENDS: dict[str, BackendFactory] = {
    "torch": _torch_backend,
    "flashinfer": _flashinfer_backend,
    "fa3": _fa3_backend,
    "xqa": _xqa_backend,
}

_registered: dict[str, BackendFactory] = dict(BUILTIN_BACKENDS)


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register (or replace: the last registration of a name wins) the factory of a backend."""
    _registered[name] = factory


def registered_backends() -> dict[str, BackendFactory]:
    return dict(_registered)
