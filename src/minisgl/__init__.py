"""minisgl: a fast SGLang-style LLM inference runtime and a backend for the tools people use."""

from __future__ import annotations

from typing import Any

from minisgl.core import CompletionOutput, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM", "SamplingParams", "Client", "AsyncClient", "CompletionOutput", "GenerateResult", "Chunk", "Usage",
    "__version__",
]

_LAZY = {
    "LLM": "minisgl.llm", "Client": "minisgl.client", "AsyncClient": "minisgl.client",
    "GenerateResult": "minisgl.client", "Chunk": "minisgl.client", "Usage": "minisgl.client",
}


def __getattr__(name: str) -> Any:
    # torch and zmq load only when the engine or the client is first used.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
