"""Model configs, the Llama-family implementation, the architecture registry and weight loading."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig
    from minisgl.models.loader import default_dtype, iter_weights, load_model, resolve_model
    from minisgl.models.registry import get_model_class

__all__ = ["ModelConfig", "default_dtype", "get_model_class", "iter_weights", "load_model", "resolve_model"]

# Lazy: a client checks a model's name (minisgl.models.names) without importing torch (seconds) for these.
_LAZY = {
    "ModelConfig": "minisgl.models.config",
    "default_dtype": "minisgl.models.loader",
    "iter_weights": "minisgl.models.loader",
    "load_model": "minisgl.models.loader",
    "resolve_model": "minisgl.models.loader",
    "get_model_class": "minisgl.models.registry",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl.models' has no attribute {name!r}")
