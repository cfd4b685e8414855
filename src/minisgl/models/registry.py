"""Architecture name -> model class, through the plugin hooks (built-ins register the same way)."""

from __future__ import annotations

from minisgl import plugins
from minisgl.errors import UnknownArchitectureError


def get_model_class(architecture: str) -> type:
    registered = plugins.architectures()
    if architecture not in registered:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported; registered architectures: "
            f"{', '.join(sorted(registered))}. A plugin can add one via the minisgl_register_architectures hook."
        )
    return registered[architecture]
