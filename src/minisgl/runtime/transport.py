"""ZMQ plumbing shared by the daemon's processes: private endpoints, sockets, worker set-up."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import zmq

from minisgl.runtime.protocol import Message, decode

LOG_FORMAT = "%(asctime)s [minisgl %(processName)s] %(levelname)s %(message)s"
# Internal pushes keep unsent messages this long at close, so a forwarded Shutdown is delivered.
LINGER_MS = 2000


def configure_logging(level: int | str = logging.INFO) -> None:
    logger = logging.getLogger("minisgl")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)


class Endpoints(NamedTuple):
    """The daemon's internal ipc endpoints, all inside one private (0700) temporary directory."""

    frontend: str  # PULL bound by the frontend: replies, errors, readiness from every worker
    router: str  # a second, unauthenticated endpoint of the public ROUTER for in-daemon clients (HTTP server)
    tokenizer: str  # PULL bound by the tokenizer worker
    scheduler: str  # PULL bound by scheduler rank 0
    detokenizer: str  # PULL bound by the detokenizer worker

    @classmethod
    def in_dir(cls, directory: Path) -> "Endpoints":
        return cls(*(f"ipc://{directory / name}.ipc" for name in cls._fields))


class PrivateDir:
    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="minisgl-"))
        os.chmod(self.path, 0o700)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


def push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.linger = LINGER_MS
    sock.sndhwm = 0  # never drop or block on internal traffic
    sock.connect(endpoint)
    return sock


def recv_ready(sock: zmq.Socket, timeout_ms: int) -> list[Message]:
    """Every message waiting on sock, waiting up to timeout_ms for the first one."""
    if not sock.poll(timeout_ms):
        return []
    msgs = []
    while True:
        try:
            msgs.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return msgs


class ParentWatch:
    """Lets a worker notice that the daemon process that started it is gone."""

    def __init__(self) -> None:
        self.ppid = os.getppid()

    @property
    def gone(self) -> bool:
        return os.getppid() != self.ppid

    def terminate_when_gone(self, poll_s: float = 1.0) -> None:
        """For a worker whose main loop is not its own (uvicorn's): from a watcher thread, SIGTERM this process
        once the daemon is gone (a killed daemon cannot stop its children)."""

        def watch() -> None:
            while not self.gone:
                time.sleep(poll_s)
            logging.getLogger("minisgl").error("the daemon process is gone; exiting")
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_setup(log_level: int) -> None:
    """A worker leaves Ctrl-C to the daemon process, which shuts everything down in order, and ends with it."""
    from minisgl.lifetime import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level)


def preload_tokenizer_modules() -> None:
    """Import what loading a HF tokenizer needs while the scheduler is still loading the model."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401
