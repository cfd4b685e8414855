"""The built-in models and attention backends, registered through the same hooks as any plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from minisgl.hooks import hookimpl

if TYPE_CHECKING:
    import torch

    from minisgl.attention.base import AttentionBackend
    from minisgl.kvcache.pool import KVPool
    from minisgl.models.config import ModelConfig

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _torch_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    from minisgl.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(model_config, kv_pool, page_table, device)


def _flashinfer_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    from minisgl.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(model_config, kv_pool, page_table, device, prefill_backend="fa2")


def _fa3_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    # FlashAttention-3 prefill (Hopper) through flashinfer; decode stays on flashinfer's tensor-core kernel.
    from minisgl.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(model_config, kv_pool, page_table, device, prefill_backend="fa3")


def _xqa_backend(
    model_config: "ModelConfig", kv_pool: "KVPool", page_table: "torch.Tensor", device: Any
) -> "AttentionBackend":
    # TensorRT-LLM's XQA decode kernel through flashinfer (decode only: the engine pairs it with a prefill backend).
    from minisgl.attention.xqa import XqaBackend

    return XqaBackend(model_config, kv_pool, page_table, device)


# name -> factory(model_config, kv_pool, page_table, device); factories import their backend lazily
# so that listing backends never pulls in GPU-only packages.
ATTENTION_BACKENDS: dict[str, Callable[..., "AttentionBackend"]] = {
    "torch": _torch_backend,
    "flashinfer": _flashinfer_backend,
    "fa3": _fa3_backend,
    "xqa": _xqa_backend,
}


@hookimpl
def minisgl_register_architectures() -> dict[str, Any]:
    # A reference, loaded by minisgl.plugins: the models consult the registry, so the registry
    # (and this plugin) must not import them.
    return {name: "minisgl.models.llama:LlamaForCausalLM" for name in LLAMA_FAMILY}


@hookimpl
def minisgl_register_attention_backends() -> dict[str, Callable[..., Any]]:
    return dict(ATTENTION_BACKENDS)
