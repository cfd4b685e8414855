"""Where daemons live: the per-user runtime directory, default addresses and address checks."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

from minisgl import env
from minisgl.config import EngineConfig
from minisgl.errors import ConfigError

# Unix socket paths longer than this do not fit sockaddr_un.sun_path.
MAX_IPC_PATH = 100


def runtime_dir() -> Path:
    """$MINISGL_RUNTIME_DIR, else $XDG_RUNTIME_DIR/minisgl, else ~/.cache/minisgl/run (created 0700)."""
    path = env.RUNTIME_DIR.get()
    if path is None:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        path = Path(xdg) / "minisgl" if xdg else Path.home() / ".cache" / "minisgl" / "run"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def config_fingerprint(config: EngineConfig) -> str:
    """A short hash of everything that changes what a daemon serves (the model and every engine option)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def daemon_name(config: EngineConfig) -> str:
    """E.g. "smollm2-1a2b3c4d": the model's last path component plus the config fingerprint."""
    base = Path(config.model.rstrip("/")).name or "model"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", base)[:40]
    return f"{slug}-{config_fingerprint(config)}"


def default_address(config: EngineConfig) -> str:
    return f"ipc://{runtime_dir() / daemon_name(config)}.sock"


class Address(NamedTuple):
    url: str
    scheme: str  # "ipc" | "tcp"
    path: str | None  # ipc: the socket file
    host: str | None  # tcp
    port: int | None  # tcp

    @property
    def is_loopback(self) -> bool:
        return self.scheme == "ipc" or _is_loopback_host(self.host or "")


def parse_address(url: str) -> Address:
    """Check an ipc:///path or tcp://host:port address; raise ConfigError saying what is wrong."""
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if not path.startswith("/"):
            raise ConfigError(f"ipc address {url!r} must name an absolute socket path (ipc:///run/...)")
        if len(path) > MAX_IPC_PATH:
            raise ConfigError(f"ipc socket path is too long ({len(path)} > {MAX_IPC_PATH} chars): {path}")
        return Address(url, "ipc", path, None, None)
    if url.startswith("tcp://"):
        hostport = url[len("tcp://") :]
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ConfigError(f"tcp address {url!r} must be tcp://HOST:PORT")
        return Address(url, "tcp", None, host.strip("[]"), int(port))
    raise ConfigError(f"unsupported address {url!r}: use ipc:///path/to/socket or tcp://127.0.0.1:PORT")


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere
