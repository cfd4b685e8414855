"""Process faults of `minisgl serve --http-port P` (a tiny model on the CPU), kill -9 included: a daemon's death ends
its HTTP streams with each API's error event (OpenAI's SSE `data: {"error": ...}`, the Responses API's `error` event,
Ollama's NDJSON error line), and `minisgl ps` then removes the socket, lock, registry entry and private directory it
left (and nothing of a live daemon's); an HTTP server process that keeps failing stops its daemon loudly instead of
restarting forever. (A killed HTTP server restarted on its port while a ZeroMQ stream beside it goes on is in
test_faults_hostile.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import pytest
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_gone, wait_http  # noqa: F401 - fixtures

from minisgl.runtime.registry import DaemonRecord, FileLock, Registry
from minisgl.runtime.supervisor import Restarts
from minisgl.runtime.transport import OWNER_LOCK, PRIVATE_PREFIX, remove_stale_private_dirs

LONG = 400  # tokens: far more than a stream yields before the kill
CHAT = [{"role": "user", "content": "hi"}]


def test_restarts_back_off_and_give_up_after_failures_in_a_row() -> None:
    restarts = Restarts(delays=(0.5, 1.0, 2.0), stable_s=30.0)
    assert [restarts.after_exit(1.0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert restarts.after_exit(29.0) is None  # a fourth short run in a row: give up
    healthy = Restarts(delays=(0.5, 1.0), stable_s=30.0)
    assert [healthy.after_exit(1.0), healthy.after_exit(1.0)] == [0.5, 1.0]
    assert healthy.after_exit(3600.0) == 0.5  # a long run ends the row: a fresh start of the count
    assert healthy.after_exit(0.1) == 1.0


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_daemons_private_directories_are_removed(tmp_path: Path) -> None:
    dead = dead_pid()

    def private(pid: int, lock: str | None = None) -> Path:
        path = tmp_path / f"{PRIVATE_PREFIX}{pid}-{lock or 'nolock'}"
        path.mkdir()
        (path / "frontend.ipc").touch()
        if lock is not None:
            (path / OWNER_LOCK).touch()
        return path

    left = private(dead, "free")  # what a killed daemon leaves: its pid gone, its lock free
    live = private(os.getpid(), "held")
    held = private(dead, "held-elsewhere")  # a daemon of another pid namespace sharing the directory holds it
    new = private(dead)  # made a moment ago: its daemon has not taken the lock yet
    other = tmp_path / f"{PRIVATE_PREFIX}tp-{dead}-x"  # not a daemon's private directory
    other.mkdir()
    locks = [FileLock(path / OWNER_LOCK) for path in (live, held)]
    assert all(lock.try_acquire() for lock in locks)
    try:
        assert remove_stale_private_dirs(tmp_path) == [left]
    finally:
        for lock in locks:
            lock.release()
    assert all(p.exists() for p in (live, held, new, other))


def test_a_scan_leaves_a_dead_daemons_socket_to_the_daemon_starting_there(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(prefix="msgl-") as short:  # an ipc path must fit in 100 characters
        monkeypatch.setenv("MINISGL_RUNTIME_DIR", short)
        registry, sock = Registry(), Path(short) / "d.sock"
        record = DaemonRecord(f"ipc://{sock}", "m", dead_pid(), {}, 1.0)
        registry.add(record)
        sock.touch()
        starting = FileLock(Path(f"{sock}.lock"))
        assert starting.try_acquire()  # a new daemon claimed the address and is about to bind it
        assert registry.records() == [] and sock.exists() and starting.path.exists()
        starting.release()
        assert registry.records() == [] and not sock.exists() and not starting.path.exists()
        assert registry.get(record.address) is None


@pytest.fixture(scope="module")
def launched(tiny_model_dir, daemon_runtime_dir) -> Iterator[SimpleNamespace]:  # noqa: F811
    """The module's two daemons of the tiny model, each with HTTP on a port of its own, started at once: one a test
    kills, one whose HTTP server a test makes fail."""
    model = str(tiny_model_dir("llama"))
    daemons = SimpleNamespace()
    for name in ("killed", "looping"):
        address, log, port = f"ipc://{daemon_runtime_dir}/{name}.sock", daemon_runtime_dir / f"{name}.log", free_port()
        args = ["--model", model, "--device", "cpu", "--num-pages", "1024", "--address", address]
        proc = start_serve([*args, "--http-port", str(port), "--served-model-name", "tiny"], log)
        setattr(daemons, name, SimpleNamespace(address=address, log=log, proc=proc, port=port))
    try:
        yield daemons
    finally:
        for d in vars(daemons).values():
            if d.proc.poll() is None:
                d.proc.kill()
            d.proc.wait(timeout=60)


def ready(daemon: SimpleNamespace) -> SimpleNamespace:
    """The daemon once its HTTP server answers, with its base URL and its processes' pids."""
    daemon.base = wait_http(daemon.port, daemon.proc, daemon.log, timeout=300)
    from minisgl.client import Client

    with Client("tiny", daemon.address, auto_start=False, timeout=60) as client:
        daemon.workers = client.stats()["workers"]
    return daemon


class Lines:
    """The lines of one streamed HTTP answer, read in a thread until the server ends the stream; `started` is set
    once the first line has come."""

    def __init__(self, path: str, body: dict[str, Any], base: str) -> None:
        self.lines: list[str] = []
        self.ended: float | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(f"{base}{path}", body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()[:300]
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.TransportError as e:
            self.lines.append(f"transport error: {type(e).__name__}: {e}")
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def data(self) -> list[Any]:
        """The JSON payloads of the stream's `data:` lines (SSE) or of its lines (NDJSON), [DONE] left out."""
        out = []
        for line in self.lines:
            text = line[len("data: ") :] if line.startswith("data: ") else line
            if text.strip() and text != "[DONE]" and not line.startswith("event: "):
                out.append(json.loads(text))
        return out


def test_a_killed_daemon_ends_http_streams_with_error_events_and_ps_removes_what_it_left(launched):
    d = ready(launched.killed)
    private = list(Path(tempfile.gettempdir()).glob(f"minisgl-{d.proc.pid}-*"))
    socket_path = Path(d.address[len("ipc://") :])
    lock_path = Path(f"{socket_path}.lock")
    registry_entries = list((Path(os.environ["MINISGL_RUNTIME_DIR"]) / "daemons").glob("*.json"))
    assert len(private) == 1 and socket_path.exists() and lock_path.exists() and len(registry_entries) == 2
    streams = {
        "chat": Lines(
            "/v1/chat/completions",
            {"model": "tiny", "messages": CHAT, "max_tokens": LONG, "stream": True, "ignore_eos": True},
            d.base,
        ),
        "responses": Lines(
            "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": LONG, "stream": True}, d.base
        ),
        "ollama": Lines("/api/generate", {"model": "tiny", "prompt": "hi", "options": {"num_predict": LONG}}, d.base),
    }
    for name, s in streams.items():
        assert s.started.wait(120) and s.ended is None, (name, s.lines)
    os.kill(d.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    for s in streams.values():
        s.thread.join(30)
    ends = {name: s.ended - killed for name, s in streams.items()}
    chat, responses, ollama = (streams[name].data() for name in ("chat", "responses", "ollama"))
    assert streams["chat"].lines[-1] == "data: [DONE]" and set(chat[-1]) == {"error"}, streams["chat"].lines[-3:]
    assert chat[-1]["error"]["type"] == "service_unavailable" and chat[-1]["error"]["message"], chat[-1]
    assert streams["responses"].lines[-2] == "event: error" and responses[-1]["type"] == "error", responses[-1]
    assert set(ollama[-1]) == {"error"} and ollama[-1]["error"], ollama[-1]
    assert max(ends.values()) < 10, ends
    assert wait_gone([pid for pid in d.workers.values()], 30) == []  # the HTTP server exits with it

    out = subprocess.run([sys.executable, "-m", "minisgl", "ps"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and d.address not in out.stdout, out
    assert not private[0].exists() and not socket_path.exists() and not lock_path.exists()
    assert len(list(registry_entries[0].parent.glob("*.json"))) == 1  # the other daemon's entry stays


def test_an_http_server_whose_port_is_taken_at_its_restart_stops_the_daemon_loudly(launched):
    """The HTTP process is killed and another process takes its port before the restart: the daemon stops at once
    (exit 1) naming the port and its holder, rather than restarting into a taken port again and again (the back-off
    and its limit: test_restarts_back_off_and_give_up_after_failures_in_a_row)."""
    d = ready(launched.looping)
    taken = socket.socket()
    try:
        os.kill(d.workers["http"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # the port is free once the killed process is gone: take it before the restart does
            try:
                taken.bind(("127.0.0.1", d.port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        taken.listen()
        assert d.proc.wait(120) == 1
    finally:
        taken.close()
    log = d.log.read_text()
    # At most one restart: the supervisor either finds the port taken before it restarts (the port check) or
    # restarts once and the new server cannot bind; it never restarts into the taken port again.
    assert log.count(f"starting it again on http://127.0.0.1:{d.port}") <= 1, log[-3000:]
    assert f"HTTP port {d.port} on 127.0.0.1 is taken" in log and f"(pid {os.getpid()})" in log, log[-3000:]
    assert "stopping the daemon" in log, log[-3000:]
    assert wait_gone(list(d.workers.values()), 30) == []
