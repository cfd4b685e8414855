"""The OpenAI-compatible HTTP server and the interactive shell, both clients of the daemon."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "run_http_server", "run_shell"]

_LAZY = {
    "create_app": "minisgl.server.app",
    "run_http_server": "minisgl.server.app",
    "run_shell": "minisgl.server.shell",
}


def __getattr__(name: str) -> Any:
    # The shell must not pay for importing FastAPI.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl.server' has no attribute {name!r}")
