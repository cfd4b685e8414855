"""The secret the ranks of one tensor-parallel engine share, and the signatures made with it.

Every control message (distributed/channel.py) is HMAC-signed with it and typed msgpack (never pickle); across
hosts the channel's CURVE keys derive from it too, and a rank > 0 says a signed hello before rank 0 lets the
process group form.

The secret never travels on argv (where `ps` shows it): rank 0 of a one-node engine makes a fresh one and hands
it to its ranks in their environment; a multi-node run gives every node the same one in MINISGL_TP_SECRET or in
a file only its owner can read (EngineConfig.tp_secret_file, `--tp-secret-file`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from minisgl import env
from minisgl.config import EngineConfig
from minisgl.errors import ConfigError
from minisgl.lifetime import parent_env

SECRET_ENV = env.TP_SECRET.name
_SIG_BYTES = hashlib.sha256().digest_size


class AuthError(ConfigError):
    """The engine's shared secret is missing, unreadable or not private."""


def load_secret(config: EngineConfig) -> bytes:
    """The engine's shared secret: MINISGL_TP_SECRET, else tp_secret_file, else (one node only) a fresh one."""
    secret = env.TP_SECRET.get()
    if secret:
        return secret.encode()
    if config.tp_secret_file:
        return _read_secret_file(Path(config.tp_secret_file).expanduser())
    if config.nnodes > 1:
        raise AuthError(
            "multi-node tensor parallelism needs a shared secret on every node: set MINISGL_TP_SECRET "
            "or give --tp-secret-file (a file only you can read, e.g. `openssl rand -hex 32 > f; chmod 600 f`)"
        )
    return secrets.token_hex(32).encode()


def _read_secret_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        secret = path.read_bytes().strip()
    except OSError as e:
        raise AuthError(f"cannot read the tensor-parallel secret file {path}: {e}") from e
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"the tensor-parallel secret file {path} is readable by others: chmod 600 {path}")
    if len(secret) < 16:
        raise AuthError(f"the tensor-parallel secret in {path} is too short: use at least 16 characters")
    return secret


def child_env(secret: bytes) -> dict[str, str]:
    """The environment of a rank process: this one's, plus the secret (and this pid: it ends with this process)."""

    return parent_env({**os.environ, SECRET_ENV: secret.decode()})


def sign(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def verify(secret: bytes, blob: bytes) -> bytes | None:
    """The payload of a signed blob, or None when the signature is not the secret's."""
    sig, payload = blob[:_SIG_BYTES], blob[_SIG_BYTES:]
    good = hmac.new(secret, payload, hashlib.sha256).digest()
    return payload if len(sig) == _SIG_BYTES and hmac.compare_digest(sig, good) else None
