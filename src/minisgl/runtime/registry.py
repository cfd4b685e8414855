"""One JSON file per running daemon (address, model, pid, config), so clients and `minisgl stop` find them.

A daemon that was killed cannot remove its file, its ipc socket or the socket's lock: the next scan of the
registry (`minisgl ps`, a client looking for a daemon, a daemon starting) removes them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from minisgl.errors import DaemonError, DaemonTimeoutError, MiniSGLError
from minisgl.lifetime import pid_alive
from minisgl.runtime.addresses import Address, parse_address, runtime_dir

logger = logging.getLogger("minisgl")
CLAIM_WAIT_S = 0.5


class DaemonRecord(NamedTuple):
    address: str
    model: str
    pid: int
    config: dict[str, Any]  # EngineConfig.to_dict()
    started_at: float
    curve_dir: str | None = None  # a tcp daemon's CURVE key directory: local clients take their keys there

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


def _ipc_path(address: str) -> str | None:
    try:
        parsed = parse_address(address)
    except MiniSGLError:
        return None
    return parsed.path if parsed.scheme == "ipc" else None


class Registry:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or runtime_dir()) / "daemons"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, address: str) -> Path:
        return self.root / f"{hashlib.sha256(address.encode()).hexdigest()[:16]}.json"

    def add(self, record: DaemonRecord) -> None:
        path = self._path(record.address)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record._asdict(), f)
        os.replace(tmp, path)

    def claim(self, address: Address) -> FileLock | None:
        """Lock an ipc address for this process's daemon (a socket a killed one left is removed); DaemonError when
        another daemon holds it. A tcp port is claimed by binding it: None."""
        if address.scheme != "ipc":
            return None
        path = Path(address.path or "")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = FileLock(path.with_name(path.name + ".lock"))
        try:
            lock.acquire(CLAIM_WAIT_S)  # a scan removing a dead daemon's files holds it for a moment
        except DaemonTimeoutError:
            other = self.get(address.url)
            who = f" (pid {other.pid}, model {other.model})" if other else ""
            raise DaemonError(
                f"another minisgl daemon already serves {address.url}{who}: use it, stop it with "
                f"`minisgl stop --address {address.url}`, or pick another --address"
            ) from None
        path.unlink(missing_ok=True)
        return lock

    def release(self, address: Address, lock: FileLock | None) -> None:
        """Forget this process's daemon at address: its entry, and its ipc socket and lock (claim's)."""
        self.remove(address.url, os.getpid())
        if lock is not None:
            Path(address.path or "").unlink(missing_ok=True)
            lock.path.unlink(missing_ok=True)
            lock.release()

    def remove(self, address: str, pid: int | None = None) -> None:
        """Forget the daemon at address (only if it is still the one with this pid, when given)."""
        record = self.get(address)
        if record is not None and (pid is None or record.pid == pid):
            self._path(address).unlink(missing_ok=True)

    def get(self, address: str) -> DaemonRecord | None:
        return self._read(self._path(address))

    def records(self) -> list[DaemonRecord]:
        """Every registered daemon whose process is still alive; what a dead one left is removed (forget_dead)."""
        out = []
        for path in sorted(self.root.glob("*.json")):
            record = self._read(path)
            if record is None:
                continue
            if not record.alive:
                self.forget_dead(record)
                continue
            out.append(record)
        return out

    def forget_dead(self, record: DaemonRecord) -> None:
        """Remove a dead daemon's entry and, for an ipc address, its socket and the socket's lock. Nothing is
        touched while another daemon holds that lock (it is starting at the address and will replace the entry)."""
        path = _ipc_path(record.address)
        lock = FileLock(Path(f"{path}.lock")) if path else None
        try:
            if lock is not None and not lock.try_acquire(create=False) and lock.path.exists():
                return
            self.remove(record.address, record.pid)
            if lock is not None and lock.held:
                Path(path or "").unlink(missing_ok=True)
                lock.path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("cannot remove what the dead daemon (pid %d) at %s left: %s", record.pid, record.address, e)
            return
        finally:
            if lock is not None:
                lock.release()
        logger.info("removed what the dead daemon (pid %d) at %s left", record.pid, record.address)

    def find(self, model: str, config: dict[str, Any] | None = None) -> list[DaemonRecord]:
        """Daemons serving model (with exactly this config when given); the newest first."""
        found = [r for r in self.records() if r.model == model and (config is None or r.config == config)]
        return sorted(found, key=lambda r: -r.started_at)

    @staticmethod
    def _read(path: Path) -> DaemonRecord | None:
        try:
            return DaemonRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


class FileLock:
    """An exclusive flock on a file; released when closed or when the process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, create: bool = True) -> bool:
        """Take the lock if it is free (create: make the file if it is missing; else a missing file is not taken).
        The lock taken is the file at the path now: its holder may remove the file (as a stopping daemon does)
        while another process opens it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
            except FileNotFoundError:
                if create:
                    raise
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    self._fd = fd
                    return True
            except BlockingIOError:
                os.close(fd)
                return False
            except FileNotFoundError:
                pass
            os.close(fd)  # removed (or replaced) as we took it: take the file at the path now

    def acquire(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.try_acquire():
            if time.monotonic() > deadline:
                raise DaemonTimeoutError(
                    f"timed out after {timeout:.0f}s waiting for the lock {self.path} "
                    "(another process is starting this daemon): retry with a larger timeout"
                )
            time.sleep(0.05)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
