"""The built-in models and attention backends, registered through the same hooks as any plugin.

The tables themselves live with their registries (minisgl.models.registry, minisgl.attention.registry).
"""

from __future__ import annotations

from typing import Any, Callable

from minisgl.attention.registry import BUILTIN_BACKENDS
from minisgl.hooks import hookimpl
from minisgl.models.registry import BUILTIN_ARCHITECTURES


@hookimpl
def minisgl_register_architectures() -> dict[str, Any]:
    return dict(BUILTIN_ARCHITECTURES)


@hookimpl
def minisgl_register_attention_backends() -> dict[str, Callable[..., Any]]:
    return dict(BUILTIN_BACKENDS)
