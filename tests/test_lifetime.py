"""No process minisgl starts outlives its parent: daemon workers, tensor-parallel ranks, benchmark children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from daemon_fixtures import wait_gone
from minisgl.lifetime import PARENT_ENV, parent_env

CHILD = "from minisgl.lifetime import die_with_parent; import time; die_with_parent(); time.sleep(120)"


def start_parent(script: str) -> tuple[subprocess.Popen, int]:
    """A python process running script, which prints "pid N" for its child; (the process, the child's pid)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline()
    while not line.startswith("pid "):
        line = parent.stdout.readline()
    return parent, int(line.split()[1])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_command_dies_with_its_parent(sig):
    parent, child = start_parent(
        f"""
        import subprocess, sys, time
        from minisgl.lifetime import parent_env
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=parent_env(), start_new_session=True)
        print("pid", child.pid, flush=True)
        time.sleep(120)
        """
    )
    time.sleep(1.0)  # the child has set its parent-death signal
    assert wait_gone([child], 0) == [child]
    parent.send_signal(sig)
    parent.wait(timeout=10)
    assert wait_gone([child], 5) == []


def test_the_parent_pid_is_not_inherited_by_grandchildren():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{CHILD.split(';')[0]}; import os; die_with_parent(); print(os.environ.get({PARENT_ENV!r}))",
        ],
        env=parent_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_benchmark_stops_its_children_own_session_included_on_sigterm_or_ctrl_c(sig):
    parent, child = start_parent(
        f"""
        import signal, subprocess, sys
        from minisgl.bench import tp_support as tp
        from minisgl.lifetime import raise_on_sigterm
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when this test runs under a shell that started it
        # in the background: such a shell ignores SIGINT, and Python then keeps ignoring it (so do its children).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise_on_sigterm()
        real = subprocess.Popen
        def popen(*args, **kwargs):
            proc = real(*args, **kwargs)
            print("pid", proc.pid, flush=True)
            return proc
        tp.subprocess.Popen = popen
        tp.run_child([sys.executable, "-c", {CHILD!r}], timeout=120)
        """
    )
    time.sleep(1.0)
    parent.send_signal(sig)
    parent.wait(timeout=10)
    assert wait_gone([child], 5) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_process_of_a_tp2_daemon_outlives_it(tiny_model_dir, sig):
    """`minisgl serve --tp 2` on the CPU (gloo): its scheduler, text worker and rank 1 all end within seconds of the
    daemon process, whether it is stopped (SIGINT, SIGTERM) or killed (SIGKILL)."""
    from minisgl.runtime.launcher import wait_ready

    runtime = tempfile.mkdtemp(prefix="msgl-")
    address = f"ipc://{runtime}/d.sock"
    log_path = Path(runtime) / "serve.log"
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", str(tiny_model_dir("llama")), "--tp", "2"]
    with open(log_path, "ab") as log:
        daemon = subprocess.Popen(
            [*cmd, "--device", "cpu", "--num-pages", "256", "--address", address, "--no-http"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MINISGL_RUNTIME_DIR": runtime},
        )
    children: list[psutil.Process] = []
    try:
        wait_ready(address, 300, proc=daemon, log_path=log_path)
        children = psutil.Process(daemon.pid).children(recursive=True)
        assert any("minisgl.runtime.tp" in " ".join(c.cmdline()) for c in children), children
        daemon.send_signal(sig)
        daemon.wait(timeout=60)
        assert wait_gone([c.pid for c in children], 10) == []
    finally:
        if daemon.poll() is None:
            daemon.kill()
        for c in children:  # only this daemon's: other tests' daemons may be running
            try:
                c.kill()
            except psutil.Error:
                pass
