"""One JSON file per running daemon (address, model, pid, config), so clients and `minisgl stop` find them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from minisgl.errors import DaemonTimeoutError
from minisgl.runtime.addresses import runtime_dir


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

    def remove(self, address: str, pid: int | None = None) -> None:
        """Forget the daemon at address (only if it is still the one with this pid, when given)."""
        record = self.get(address)
        if record is not None and (pid is None or record.pid == pid):
            self._path(address).unlink(missing_ok=True)

    def get(self, address: str) -> DaemonRecord | None:
        return self._read(self._path(address))

    def records(self) -> list[DaemonRecord]:
        """Every registered daemon whose process is still alive (stale files are removed)."""
        out = []
        for path in sorted(self.root.glob("*.json")):
            record = self._read(path)
            if record is None:
                continue
            if not record.alive:
                path.unlink(missing_ok=True)
                continue
            out.append(record)
        return out

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

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

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
