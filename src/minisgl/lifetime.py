"""No process minisgl starts outlives its parent, whatever ends the parent (SIGKILL included).

A child calls die_with_parent first thing: on Linux the kernel signals it when its parent dies
(prctl PR_SET_PDEATHSIG); elsewhere a thread watches the parent. Children started as commands learn their
parent's pid from MINISGL_PARENT_PID (parent_env), which they take out of their environment so that their own
children do not inherit it. A daemon that a client starts is not one of these: it is meant to outlive it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

from minisgl import env

PARENT_ENV = env.PARENT_PID.name
_PR_SET_PDEATHSIG = 1
_WATCH_S = 0.5

logger = logging.getLogger("minisgl")


def parent_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child command that must end with this process. Only from the main thread: the
    kernel's parent-death signal comes when the thread that started the child ends, not the process."""
    env = dict(os.environ if env is None else env)
    if threading.current_thread() is threading.main_thread():
        env[PARENT_ENV] = str(os.getpid())
    else:
        env.pop(PARENT_ENV, None)
    return env


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have this process get `sig` when `parent_pid` (default: the multiprocessing parent, else the one
    MINISGL_PARENT_PID names, else none) dies; exit now if it is gone already."""
    if parent_pid is None:
        parent_pid = _expected_parent()
    if parent_pid is None:
        return
    if sys.platform.startswith("linux") and _set_pdeathsig(sig):
        if os.getppid() != parent_pid:  # it died before the prctl: no signal will come
            os._exit(1)
        return
    threading.Thread(target=_watch, args=(parent_pid, sig), name="minisgl-parent-watch", daemon=True).start()


def _expected_parent() -> int | None:
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        return parent.pid
    pid = env.PARENT_PID.get()
    os.environ.pop(PARENT_ENV, None)  # for this process only: its own children have another parent
    return pid


def _set_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_S)
    logger.error("the parent process (pid %d) is gone; exiting", parent_pid)
    os.kill(os.getpid(), sig)


def raise_on_sigterm() -> None:
    """SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so that `finally` blocks stop the children."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def pid_alive(pid: int) -> bool:
    """True while the process runs (an exited child not yet reaped by its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"
