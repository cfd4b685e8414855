"""Model configs, the Llama-family implementation, the architecture registry and weight loading."""

from __future__ import annotations

from minisgl.models.config import ModelConfig
from minisgl.models.loader import default_dtype, iter_weights, load_model, resolve_model
from minisgl.models.registry import get_model_class

__all__ = ["ModelConfig", "default_dtype", "get_model_class", "iter_weights", "load_model", "resolve_model"]
