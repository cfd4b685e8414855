"""minisgl: a fast SGLang-style LLM inference runtime and a backend for the tools people use."""

from __future__ import annotations

import importlib
from typing import Any

from minisgl.core import CompletionOutput, SamplingParams
from minisgl.errors import (
    ConfigError,
    DaemonError,
    DaemonNotRunningError,
    DaemonTimeoutError,
    EngineError,
    GrammarError,
    InvalidRequestError,
    MiniSGLError,
    ModelLoadError,
    OutOfMemoryError,
    PromptTooLongError,
    RequestAbortedError,
    UnknownArchitectureError,
    UnknownModelError,
    WeightsError,
)

__version__ = "0.1.0"
# The public API: what the adapters (integrations/) and users import. tests/test_imports.py holds
# the adapters to these names.
__all__ = [
    "LLM",
    "SamplingParams",
    "sampling_params_from_openai",
    "Client",
    "AsyncClient",
    "CompletionOutput",
    "GenerateResult",
    "Chunk",
    "Usage",
    "Embedding",
    "DEFAULT_TIMEOUT_S",
    "PING_TIMEOUT_S",
    "ping",
    "flatten_message",
    "MiniSGLError",
    "InvalidRequestError",
    "PromptTooLongError",
    "GrammarError",
    "ConfigError",
    "ModelLoadError",
    "UnknownModelError",
    "UnknownArchitectureError",
    "WeightsError",
    "OutOfMemoryError",
    "EngineError",
    "DaemonError",
    "DaemonNotRunningError",
    "DaemonTimeoutError",
    "RequestAbortedError",
    "__version__",
]

_LAZY = {
    "LLM": "minisgl.llm",
    "Client": "minisgl.client",
    "AsyncClient": "minisgl.client",
    "GenerateResult": "minisgl.client",
    "Chunk": "minisgl.client",
    "Usage": "minisgl.client",
    "Embedding": "minisgl.client",
    "DEFAULT_TIMEOUT_S": "minisgl.client",
    "PING_TIMEOUT_S": "minisgl.client",
    "ping": "minisgl.client",
    "flatten_message": "minisgl.tokenizer",
    "sampling_params_from_openai": "minisgl.server.params",
}


def __getattr__(name: str) -> Any:
    # torch and zmq load only when the engine or the client is first used.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
