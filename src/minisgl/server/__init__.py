"""The OpenAI-compatible HTTP server and the interactive shell, both clients of the daemon."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

__all__ = ["DEFAULT_HTTP_PORT", "HttpOptions", "create_app", "run_http_server", "run_shell"]

DEFAULT_HTTP_PORT = 30000  # `minisgl serve`'s HTTP API, as SGLang's server


class HttpOptions(NamedTuple):
    """Where a daemon serves the HTTP API; the daemon starts `run` in a child process (it never imports
    the server itself: the runtime sits below its front ends)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # origins a browser may call from (CORS); none by default
    allowed_hosts: tuple[str, ...] = ()  # Host header names besides the bound host and loopback names
    max_request_bytes: int = 32 * 2**20  # larger bodies get a 413 before they reach the daemon
    served_model_names: tuple[str, ...] = ()  # names clients may use; the first is the one responses carry
    enable_admin: bool = False  # admin routes (/flush_cache, ...) without an API key

    def run(self, address: str, model: str, log_level: int) -> None:
        """Process entry of the HTTP server: one more client of the daemon at address."""
        from minisgl.runtime.transport import ParentWatch, worker_setup  # lazy: zmq, in the server process
        from minisgl.server.app import run_http_server  # lazy: the daemon imports HttpOptions without FastAPI
        from minisgl.server.guard import GuardOptions  # lazy: the daemon imports HttpOptions without FastAPI

        worker_setup(log_level)
        ParentWatch().terminate_when_gone()  # a killed daemon leaves no server holding the port
        guard = GuardOptions(None, self.host, self.allowed_hosts, self.allowed_origins, self.max_request_bytes)
        run_http_server(
            address,
            self.host,
            self.port,
            self.api_key,
            model_name=model,
            guard=guard,
            served_model_names=self.served_model_names,
            enable_admin=self.enable_admin,
        )


_LAZY = {
    "create_app": "minisgl.server.app",
    "run_http_server": "minisgl.server.app",
    "run_shell": "minisgl.server.shell",
}


def __getattr__(name: str) -> Any:
    # The shell must not pay for importing FastAPI.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minisgl.server' has no attribute {name!r}")
