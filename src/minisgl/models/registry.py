"""The architecture registry: a HF ``architectures`` name -> the model class that runs it.

It holds the built-ins below; the plugin loader (minisgl.plugins, above this package) adds what the
minisgl_register_architectures hook returns. A model is registered as its class or as a "module:Class"
reference (as entry points are), imported on first use, so the registry imports no model.
"""

from __future__ import annotations

import importlib
from typing import Any

from minisgl.errors import UnknownArchitectureError

# The built-in architectures: adding one is one line here.
BUILTIN_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "minisgl.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "minisgl.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "minisgl.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "minisgl.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "minisgl.models.moe:MoeForCausalLM",
    "Qwen2MoeForCausalLM": "minisgl.models.moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "minisgl.models.moe:MoeForCausalLM",
}

_registered: dict[str, Any] = dict(BUILTIN_ARCHITECTURES)  # name -> class or "module:Class"


def register_architecture(name: str, model: type | str) -> None:
    """Register (or replace: the last registration of a name wins) the model class for an architecture."""
    _registered[name] = model


def registered_architectures() -> list[str]:
    return sorted(_registered)


def get_model_class(architecture: str) -> type:
    if architecture not in _registered:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported; registered architectures: "
            f"{', '.join(registered_architectures())}. "
            "A plugin can add one via the minisgl_register_architectures hook."
        )
    model = _registered[architecture]
    if isinstance(model, str):
        _registered[architecture] = model = load_reference(model)
    return model


def load_reference(ref: str) -> Any:
    """The object a "module:attribute" reference names."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj
