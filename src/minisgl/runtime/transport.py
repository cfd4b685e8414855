"""ZMQ plumbing shared by the daemon's processes: private endpoints, sockets, worker set-up."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import zmq

from minisgl.lifetime import die_with_parent
from minisgl.runtime.protocol import Message, decode
from minisgl.runtime.registry import FileLock, pid_alive

LOG_FORMAT = "%(asctime)s [minisgl %(processName)s] %(levelname)s %(message)s"
# Internal pushes keep unsent messages this long at close, so a forwarded Shutdown is delivered.
LINGER_MS = 2000
PRIVATE_PREFIX = "minisgl-"  # a private directory is PRIVATE_PREFIX + "<daemon pid>-<random>"
OWNER_LOCK = "owner.lock"  # held by the daemon for the life of its private directory
UNLOCKED_GRACE_S = 60.0  # a private directory without its lock yet is only removed after this long (and a dead pid)


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
    """A daemon's 0700 directory of internal sockets: minisgl-<pid>-XXXX in the temporary directory, holding a lock
    for as long as its daemon lives, so that the one a killed daemon left can be told from a live one's and removed
    (remove_stale_private_dirs)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-"))
        os.chmod(self.path, 0o700)
        self._lock = FileLock(self.path / OWNER_LOCK)
        self._lock.try_acquire()  # nobody else knows the directory yet

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.release()


def remove_stale_private_dirs(root: Path | None = None) -> list[Path]:
    """Remove the private directories (in root, default: the temporary directory) that this user's daemons left when
    they died: those whose pid is gone and whose lock is free (or missing, for a while). Other users' are kept."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PRIVATE_PREFIX}*-*"):
        pid = path.name[len(PRIVATE_PREFIX) :].partition("-")[0]
        try:
            st = path.lstat()
            if not pid.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if not _private_dir_is_stale(path, int(pid), st.st_mtime):
                continue
            shutil.rmtree(path)
        except OSError:
            continue  # removed meanwhile, or not ours to remove
        removed.append(path)
        logging.getLogger("minisgl").info("removed the private directory of a dead daemon: %s", path)
    return removed


def _private_dir_is_stale(path: Path, pid: int, mtime: float) -> bool:
    if pid_alive(pid):
        return False  # its daemon, or a process that took its pid since: kept either way
    lock = FileLock(path / OWNER_LOCK)
    if lock.try_acquire(create=False):
        lock.release()  # no daemon holds it, in this pid namespace or another one sharing the directory
        return True
    return not lock.path.exists() and time.time() - mtime > UNLOCKED_GRACE_S


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


def router_socket(ctx: zmq.Context, max_message_bytes: int) -> zmq.Socket:
    """A daemon's ROUTER for clients: a reply it cannot route raises EHOSTUNREACH (that client is gone)."""
    router = ctx.socket(zmq.ROUTER)
    router.router_mandatory = 1
    router.sndhwm = 0
    router.maxmsgsize = max_message_bytes  # a bigger message drops that connection only
    router.linger = 1000  # flush the error replies of a shutdown
    return router


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

    def terminate_when_gone(self) -> None:
        """For a worker whose main loop is not its own (uvicorn's): SIGTERM, not worker_setup's SIGKILL, once the
        daemon is gone (a killed daemon cannot stop its children), so that the worker ends its clients' streams with
        an error before it exits (uvicorn's graceful shutdown)."""
        die_with_parent(self.ppid, signal.SIGTERM)


def worker_setup(log_level: int) -> None:
    """A worker leaves Ctrl-C to the daemon process, which shuts everything down in order, and ends with it."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level)


def preload_tokenizer_modules() -> None:
    """Import what loading a HF tokenizer needs while the scheduler is still loading the model."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401
