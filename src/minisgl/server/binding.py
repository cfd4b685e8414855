"""Which hosts the HTTP server may bind: apart from the routes, so that `minisgl serve` refuses a public bind
without an API key before the model loads, without importing FastAPI."""

from __future__ import annotations

import ipaddress

from minisgl.errors import ConfigError

_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def check_bind(host: str, api_key: str | None) -> None:
    """Binding anything but a loopback address needs an api_key (ConfigError otherwise)."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"refusing to serve HTTP on {host!r} without an API key: pass --api-key (or bind 127.0.0.1)")


def is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
