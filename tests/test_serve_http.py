"""`minisgl serve` serves the HTTP API by default (127.0.0.1:30000; ZeroMQ only with --no-http or --http-port 0);
a taken port, default or given, stops it before the model loads, naming the process that holds the port; and
--served-model-name gives the names /v1/models lists and requests may use (checked with the real openai package).
Auto-started daemons never open HTTP. Its front end (the main process and the HTTP process) loads without torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from tests.daemon_fixtures import daemon_runtime_dir, free_port, start_serve, wait_http  # noqa: F401 - a fixture

from minisgl import cli
from minisgl.runtime.supervisor import HttpChild, port_taken
from minisgl.server import DEFAULT_HTTP_PORT, HttpOptions


def _http(argv: list[str]) -> Any:
    return cli._http_options(cli.build_parser().parse_args(["serve", *argv]))


def test_the_front_end_loads_without_torch_xgrammar_or_transformers():
    """`minisgl serve`'s main process (the daemon's supervisor, which checks the bind before the model loads) and its
    HTTP process (the routes) never import what the scheduler needs: torch, xgrammar and transformers took ~4 s of CPU
    in each, before the scheduler started."""
    code = (
        "import sys, minisgl.cli, minisgl.runtime.daemon, minisgl.server.app\n"
        "print(sorted({'torch', 'xgrammar', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_serve_listens_on_the_default_port_on_loopback():
    default = _http([])
    assert (default.host, default.port, default.served_model_names) == ("127.0.0.1", DEFAULT_HTTP_PORT, ())
    assert DEFAULT_HTTP_PORT == 30000


@pytest.mark.parametrize("argv", [["--no-http"], ["--http-port", "0"]])
def test_no_http_and_port_0_serve_zeromq_only(argv):
    assert _http(argv) is None


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_taken_names_the_port_and_this_process(held_port: int):
    taken = port_taken("127.0.0.1", held_port)
    assert taken is not None and str(held_port) in taken and f"pid {os.getpid()}" in taken
    assert port_taken("127.0.0.1", free_port()) is None


def test_an_http_process_that_cannot_bind_stops_the_daemon_at_once(held_port: int):
    child = HttpChild(HttpOptions(port=held_port), (), spawn=lambda proc: None)
    child.start()
    dead = SimpleNamespace(pid=1234, exitcode=1)
    reason = child.exited(dead, 0)  # the first failure, not after the restarts
    assert reason is not None and str(held_port) in reason and f"pid {os.getpid()}" in reason


def test_serve_on_a_taken_port_fails_before_loading_and_no_http_starts(
    held_port: int,
    daemon_runtime_dir: Path,  # noqa: F811
    tiny_model_dir: Any,
):
    model = str(tiny_model_dir("llama"))
    argv = [sys.executable, "-m", "minisgl", "serve", "--model", model, "--num-pages", "64"]
    address = f"ipc://{daemon_runtime_dir}/taken.sock"
    began = time.monotonic()
    failed = subprocess.run(
        [*argv, "--address", address, "--http-port", str(held_port)], capture_output=True, timeout=120
    )
    assert failed.returncode != 0, failed.stderr.decode()
    assert time.monotonic() - began < 60  # refused before the model loads
    message = failed.stderr.decode()
    assert f"HTTP port {held_port}" in message and f"pid {os.getpid()}" in message, message
    log = daemon_runtime_dir / "no-http.log"
    proc = start_serve(["--model", model, "--address", address, "--num-pages", "64", "--no-http"], log)
    try:
        deadline = time.monotonic() + 300
        while "ready: serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(60)


def test_served_model_names_are_listed_and_accepted(daemon_runtime_dir: Path, tiny_model_dir: Any):  # noqa: F811
    import openai

    model = str(tiny_model_dir("llama"))
    port = free_port()
    address = f"ipc://{daemon_runtime_dir}/named.sock"
    log = daemon_runtime_dir / "named.log"
    argv = ["--model", model, "--address", address, "--http-port", str(port), "--num-pages", "256"]
    proc = start_serve([*argv, "--served-model-name", "tiny", "tiny-alias"], log)
    try:
        base = wait_http(port, proc, log, timeout=300)
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in oai.models.list().data] == ["tiny", "tiny-alias"]
        for name in ("tiny", "tiny-alias", model):
            reply = oai.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
            )
            assert reply.model == "tiny" and reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        proc.terminate()
        proc.wait(60)
