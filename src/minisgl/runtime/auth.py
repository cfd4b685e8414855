"""ZMQ CURVE authentication for daemons reachable from other hosts (keys live in files).

Layout of the key directory ($MINISGL_CURVE_DIR, else ~/.config/minisgl/curve):
    server.key, server.key_secret      the daemon's keypair (created on first use)
    authorized_clients/NAME.key        public keys of the clients allowed in
    clients/NAME.key_secret            a client's keypair, made by `minisgl keys --client NAME`
    clients/local.key_secret           the keypair of the daemon's own user (made by a loopback tcp daemon)
A client connects with its .key_secret file and the server's public server.key
(Client(curve_client_key=..., curve_server_key=...) or $MINISGL_CURVE_CLIENT_KEY / _SERVER_KEY). Every tcp daemon
uses CURVE (a loopback port is open to every local user); a client given no keys that finds a tcp daemon in the
registry uses the local keypair of the key directory the daemon registered (0600 files: its own user only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from minisgl import env
from minisgl.errors import ConfigError
from minisgl.runtime.registry import Registry

logger = logging.getLogger("minisgl")

ZAP_DOMAIN = "minisgl"


def curve_dir() -> Path:
    if (path := env.CURVE_DIR.get()) is not None:
        return path
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "minisgl" / "curve"


@contextlib.contextmanager
def _private_files() -> Iterator[None]:
    """Files and directories made inside are private from their first byte (umask 077), not chmodded after."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _private_dir(directory: Path) -> None:
    with _private_files():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)  # one made earlier, by hand or by an older minisgl


def _create_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    _private_dir(directory)
    with _private_files():
        public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


def ensure_server_keys(directory: Path) -> tuple[Path, Path]:
    """The daemon's (public, secret) key files, created when missing."""
    public, secret = directory / "server.key", directory / "server.key_secret"
    if not secret.exists():
        public, secret = _create_keypair(directory, "server")
        logger.info("created the server CURVE keypair %s (give clients %s)", secret, public)
    return public, secret


def create_client_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """A client keypair under clients/, its public key authorized under authorized_clients/."""
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ConfigError(f"a client name is a plain file name (letters, digits, '-', '_', '.'), got {name!r}")
    public, secret = _create_keypair(directory / "clients", name)
    authorized = directory / "authorized_clients"
    _private_dir(authorized)
    with _private_files():
        shutil.copy(public, authorized / public.name)
    return public, secret


LOCAL_CLIENT = "local"


def ensure_local_client_keys(directory: Path) -> None:
    """The keypair of the daemon's own user (clients/local.key_secret), authorized; created when missing."""
    if not (directory / "clients" / f"{LOCAL_CLIENT}.key_secret").exists():
        create_client_keys(directory, LOCAL_CLIENT)


def registered_curve(address: str) -> "ClientCurve | None":
    """The local keys of the tcp daemon registered at address (None: not a registered CURVE daemon)."""
    if not address.startswith("tcp://"):
        return None
    record = Registry().get(address)
    if record is None or not record.curve_dir:
        return None
    directory = Path(record.curve_dir)
    keys = ClientCurve(directory / "clients" / f"{LOCAL_CLIENT}.key_secret", directory / "server.key")
    if not all(os.access(path, os.R_OK) for path in keys):
        raise ConfigError(
            f"the daemon at {address} requires CURVE keys: run as the user that started it (its keys are "
            f"{keys.client_key} and {keys.server_key}), or have that user run `minisgl keys --client NAME "
            f"--curve-dir {directory}` and pass curve_client_key=/curve_server_key= "
            "(or $MINISGL_CURVE_CLIENT_KEY/_SERVER_KEY)"
        )
    return keys


class ServerCurve:
    """Turns a ROUTER into a CURVE server that admits only the authorized clients' keys."""

    def __init__(self, directory: Path, remote: bool = False) -> None:
        self.directory = directory
        _, self.secret_file = ensure_server_keys(directory)
        self.authorized = directory / "authorized_clients"
        # The local user's own key does not count for remote access: another machine needs a key of its own.
        keys = [p for p in self.authorized.glob("*.key") if not (remote and p.stem == LOCAL_CLIENT)]
        if not keys:
            raise ConfigError(
                f"remote access needs at least one authorized client key in {self.authorized}: "
                f"run `minisgl keys --client NAME --curve-dir {directory}` and give that client "
                f"{directory}/clients/NAME.key_secret and {directory}/server.key"
            )
        self._auth: ThreadAuthenticator | None = None

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Start the ZAP handler and make sock's next bind a CURVE server endpoint."""
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("minisgl.auth"))
        self._auth.start()
        self._auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.authorized))
        public, secret = zmq.auth.load_certificate(str(self.secret_file))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class ClientCurve(NamedTuple):
    """A client's keypair file and the server's public key file."""

    client_key: Path
    server_key: Path

    @classmethod
    def resolve(
        cls, client_key: str | os.PathLike | None, server_key: str | os.PathLike | None
    ) -> "ClientCurve | None":
        """From arguments, else $MINISGL_CURVE_CLIENT_KEY/_SERVER_KEY; None when neither is set."""
        client_key = client_key or env.CURVE_CLIENT_KEY.get()
        server_key = server_key or env.CURVE_SERVER_KEY.get()
        if not client_key and not server_key:
            return None
        if not client_key or not server_key:
            raise ConfigError("CURVE needs both the client's .key_secret file and the server's public server.key file")
        for path in (client_key, server_key):
            if not Path(path).is_file():
                raise ConfigError(f"CURVE key file {path} does not exist")
        return cls(Path(client_key), Path(server_key))

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = zmq.auth.load_certificate(str(self.client_key))
        if secret is None:
            raise ConfigError(f"{self.client_key} holds no secret key: give the client's .key_secret file")
        server_public, _ = zmq.auth.load_certificate(str(self.server_key))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
