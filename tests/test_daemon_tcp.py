"""A loopback tcp daemon is open to every user of the host: it requires CURVE, and its own user's clients find the
keys through the registry."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import pytest

from daemon_fixtures import daemon_runtime_dir, free_port, start_serve  # noqa: F401 - fixtures are used by name
from minisgl import Client, SamplingParams
from minisgl.errors import ConfigError, DaemonError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class TcpDaemon(NamedTuple):
    address: str
    keys: Path


@pytest.fixture(scope="module")
def tcp_daemon(
    daemon_runtime_dir: Path,  # noqa: F811
    tiny_model_dir: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TcpDaemon]:
    from minisgl.runtime.launcher import stop_daemon, wait_ready

    keys = tmp_path_factory.mktemp("curve")
    address, log = f"tcp://127.0.0.1:{free_port()}", daemon_runtime_dir / "tcp.log"
    args = ["--model", str(tiny_model_dir("llama")), "--address", address, "--curve-dir", str(keys)]
    proc = start_serve([*args, "--num-pages", "2048"], log)
    try:
        wait_ready(address, 180, proc=proc, log_path=log)
        yield TcpDaemon(address, keys)
        stop_daemon(address, 30)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(30)


def test_its_own_users_client_is_served_with_the_registered_keys(tcp_daemon: TcpDaemon) -> None:
    from minisgl.runtime.registry import Registry

    assert Registry().get(tcp_daemon.address).curve_dir == str(tcp_daemon.keys)
    for secret in ("server.key_secret", "clients/local.key_secret"):
        assert (tcp_daemon.keys / secret).stat().st_mode & 0o777 == 0o600
    with Client("tiny", tcp_daemon.address, auto_start=False, timeout=60) as c:
        assert len(c.generate([1, 2, 3], GREEDY).token_ids) == 4


def test_a_client_without_the_keys_is_refused(tcp_daemon: TcpDaemon, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MINISGL_RUNTIME_DIR", str(tmp_path))  # another user's view: no registry entry, no keys
    t0 = time.monotonic()
    with pytest.raises(DaemonError):
        Client("tiny", tcp_daemon.address, auto_start=False, timeout=5)
    assert time.monotonic() - t0 < 10


def test_keys_it_cannot_read_are_a_config_error_that_says_how_to_get_them(tcp_daemon: TcpDaemon) -> None:
    secret = tcp_daemon.keys / "clients" / "local.key_secret"
    shutil.move(secret, secret.with_suffix(".away"))
    try:
        with pytest.raises(ConfigError, match="requires CURVE keys.*minisgl keys --client NAME"):
            Client("tiny", tcp_daemon.address, auto_start=False, timeout=5)
    finally:
        shutil.move(secret.with_suffix(".away"), secret)


class _Starting:
    """A daemon process that is still running (wait_ready's proc)."""

    returncode = None

    def poll(self) -> None:
        return None

    def wait(self, timeout: float) -> None:
        import subprocess

        raise subprocess.TimeoutExpired("minisgl serve", timeout)


def _refusing(times: int) -> Any:
    """launcher.ping that refuses the CURVE handshake `times` times (the daemon has bound its socket, not yet
    registered its keys), then answers ready."""
    from minisgl.runtime.protocol import Pong

    calls = []

    def ping(address: str, timeout: float, curve: Any = None) -> Pong:
        calls.append(curve)
        if len(calls) <= times:
            raise DaemonError(f"the daemon at {address} refused the connection (CURVE handshake failed)")
        return Pong("r", "ready", 1, "tiny", address, "0", {})

    return ping


def test_waiting_for_a_started_tcp_daemon_outlasts_the_refusal_before_it_registers_its_keys(monkeypatch) -> None:
    from minisgl.runtime import launcher

    monkeypatch.setattr(launcher, "ping", _refusing(3))
    monkeypatch.setattr(launcher, "registered_curve", lambda address: None)  # not registered yet
    pong = launcher.wait_ready("tcp://127.0.0.1:9", 10, proc=_Starting())
    assert pong.state == "ready"


def test_a_refusal_that_outlasts_the_wait_is_the_daemons_typed_error(monkeypatch) -> None:
    from minisgl.runtime import launcher

    monkeypatch.setattr(launcher, "ping", _refusing(10**9))
    monkeypatch.setattr(launcher, "registered_curve", lambda address: None)
    t0 = time.monotonic()
    with pytest.raises(DaemonError, match="CURVE handshake failed"):
        launcher.wait_ready("tcp://127.0.0.1:9", 0.5, proc=_Starting())
    assert time.monotonic() - t0 < 10
    with pytest.raises(DaemonError, match="CURVE handshake failed"):  # no process of ours: at once
        launcher.wait_ready("tcp://127.0.0.1:9", 30)
