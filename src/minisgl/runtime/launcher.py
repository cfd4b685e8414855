"""Client side of the daemon's life: find a running daemon, start one detached, stop them.

Concurrent auto-starts of one model are serialised by a lock file, so they never start two
daemons: the first starts it, the others find it when they get the lock.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

import zmq

from minisgl import env
from minisgl.config import EngineConfig, default_of
from minisgl.errors import ConfigError, DaemonError, DaemonNotRunningError, DaemonTimeoutError
from minisgl.models.names import check_model_name
from minisgl.runtime.addresses import daemon_name, default_address, parse_address, runtime_dir
from minisgl.runtime.auth import ClientCurve, registered_curve
from minisgl.runtime.connection import SyncConnection, as_exception
from minisgl.runtime.protocol import Error, GetStats, Ping, Pong, Shutdown, StatsReply, error_class, startup_failure
from minisgl.runtime.registry import FileLock, Registry, pid_alive
from minisgl.runtime.transport import remove_stale_private_dirs

PING_TIMEOUT_S = 3.0
LOG_TAIL_LINES = 30
AUTO_IDLE_TIMEOUT_S = 300.0  # an auto-started daemon stops after 5 idle minutes (Ollama's keep_alive default)
logger = logging.getLogger("minisgl")
_announced = False  # the first auto-start of this process has been logged


def running_models() -> list[str]:
    """The models of the daemons alive in this user's registry (for an unknown model's error)."""
    try:
        return sorted({r.model for r in Registry().records() if r.alive})
    except OSError:
        return []


def auto_idle_timeout() -> float:
    """Seconds an auto-started daemon may sit idle before it stops: $MINISGL_IDLE_TIMEOUT (0 keeps it), else 300."""
    return env.IDLE_TIMEOUT.get() if env.IDLE_TIMEOUT.is_set() else AUTO_IDLE_TIMEOUT_S


def _request(address: str, msg: Any, timeout: float, curve: ClientCurve | None) -> Any:
    conn = SyncConnection(zmq.Context.instance(), address, curve)
    try:
        conn.open(msg.rid)
        conn.send(msg)
        reply = conn.next(msg.rid, timeout)
    finally:
        conn.close()
    if isinstance(reply, Error):
        raise as_exception(reply)
    return reply


def ping(address: str, timeout: float = PING_TIMEOUT_S, curve: ClientCurve | None = None) -> Pong | None:
    """The daemon's Pong, or None when nothing answers (a refused CURVE handshake raises DaemonError)."""
    addr = parse_address(address)
    if addr.scheme == "ipc" and not os.path.exists(addr.path or ""):
        return None
    try:
        return _request(address, Ping(uuid.uuid4().hex), timeout, curve)
    except (DaemonTimeoutError, DaemonNotRunningError):
        return None


def engine_flags(config: EngineConfig) -> list[str]:
    """`minisgl serve` flags that rebuild config (only the options that differ from the defaults)."""
    args = ["--model", config.model]
    for f in fields(EngineConfig):
        if f.name in ("model", "extra"):
            continue
        value, default = getattr(config, f.name), default_of(f)
        if value == default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    address: str,
    timeout: float,
    curve: ClientCurve | None = None,
    proc: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> Pong:
    """Poll the daemon at address until it reports ready; typed errors say what went wrong and where the log is."""
    deadline = time.monotonic() + timeout
    where = f"; its log: {log_path}\n{log_tail(log_path)}" if log_path is not None else ""
    while True:
        try:
            pong = ping(address, min(PING_TIMEOUT_S, max(0.1, deadline - time.monotonic())), curve)
        except DaemonError as refused:
            # A tcp daemon binds its CURVE socket, then registers its keys: a ping without keys in between is
            # refused. Retry where the keys are registered now (ping takes them), or where it is the daemon this
            # process started and it is still starting (its keys come next).
            if curve is None and address.startswith("tcp://") and time.monotonic() < deadline:
                if (proc is not None and proc.poll() is None) or registered_curve(address) is not None:
                    time.sleep(0.05)
                    continue
            # A daemon that fails to start (an unknown model, say) closes its socket, possibly in the
            # middle of our handshake: its own typed error is the one to report, not the handshake's.
            if proc is None:
                raise
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                raise refused from None  # it is alive: the refusal is real (CURVE keys)
            raise _start_failure(address, proc.returncode, log_path) from None
        if pong is not None and pong.state == "ready":
            return pong
        if proc is not None and proc.poll() is not None:
            try:  # it may have lost a race to a daemon that now serves
                pong = ping(address, PING_TIMEOUT_S, curve)
            except DaemonError:
                pong = None
            if pong is not None and pong.state != "stopping":
                return wait_ready(address, max(0.0, deadline - time.monotonic()), curve)
            raise _start_failure(address, proc.returncode, log_path)
        if proc is None and (pong is None or pong.state == "stopping"):
            raise DaemonNotRunningError(f"the minisgl daemon at {address} stopped while starting")
        if time.monotonic() >= deadline:
            where = f"; its log: {log_path}\n{log_tail(log_path)}" if log_path is not None else ""
            raise DaemonTimeoutError(
                f"the minisgl daemon at {address} was not ready within {timeout:.0f}s (it may still be loading): "
                f"retry with a larger timeout, or stop it with `minisgl stop --address {address}`{where}"
            )
        time.sleep(0.2)


def _start_failure(address: str, exit_code: int | None, log_path: Path | None) -> Exception:
    """The daemon's own typed error when it reported one (e.g. UnknownModelError), else DaemonNotRunningError."""

    if log_path is None:
        return DaemonNotRunningError(f"the minisgl daemon for {address} failed to start (exit code {exit_code})")
    failure = startup_failure(log_tail(log_path, 200))
    if failure is not None and error_class(failure[0]) is not DaemonNotRunningError:
        return error_class(failure[0])(f"{failure[1]} (the daemon could not start; its log: {log_path})")
    return DaemonNotRunningError(
        f"the minisgl daemon for {address} failed to start (exit code {exit_code}); its log: {log_path}\n"
        f"{log_tail(log_path)}"
    )


def start_daemon(config: EngineConfig, address: str, timeout: float) -> Pong:
    """Spawn `python -m minisgl serve` detached (own session, log file in the runtime dir) and wait for ready."""
    global _announced
    log_path = runtime_dir() / f"{daemon_name(config)}.log"
    idle = auto_idle_timeout()
    cmd = [sys.executable, "-m", "minisgl", "serve", *engine_flags(config), "--address", address]
    cmd += ["--idle-timeout", f"{idle:g}", "--no-http"]  # a client's own daemon: HTTP is `minisgl serve`'s
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True
        )
    pong = wait_ready(address, timeout, proc=proc, log_path=log_path)
    if not _announced:
        _announced = True
        kept = f"stops after {idle:g}s idle" if idle > 0 else "keeps running"
        logger.warning(
            "minisgl: started a daemon for %s at %s (%s; MINISGL_IDLE_TIMEOUT sets it, 0 keeps it); "
            "stop it with `minisgl stop --address %s`, its log: %s",
            config.model,
            address,
            kept,
            address,
            log_path,
        )
    return pong


def locate_daemon(
    model: str,
    address: str | None = None,
    *,
    auto_start: bool = True,
    timeout: float = 600.0,
    engine_kwargs: dict[str, Any] | None = None,
    curve: ClientCurve | None = None,
) -> str:
    """The address of a ready daemon serving model: the given address, else one from the registry
    (any config when no engine options are given, else exactly this config), else one started now."""
    engine_kwargs = engine_kwargs or {}
    config = EngineConfig.from_kwargs(model, **engine_kwargs)
    if address is not None:
        parse_address(address)
        pong = ping(address, PING_TIMEOUT_S, curve)
        if pong is not None and pong.state != "stopping":
            wait_ready(address, timeout, curve)
            return address
        if not auto_start or not parse_address(address).is_loopback:
            raise DaemonNotRunningError(
                f"no minisgl daemon answers at {address}: start one with "
                f"`minisgl serve --model {model} --address {address}` (or use auto_start=True)"
            )
        check_model_name(model, running_models)
        return _start_locked(config, address, timeout)
    for record in Registry().find(model, config.to_dict() if engine_kwargs else None):
        if parse_address(record.address).scheme == "tcp" and curve is None:
            continue  # may need keys this client does not have; the default ipc daemon is for local use
        pong = ping(record.address, PING_TIMEOUT_S, curve)
        if pong is not None and pong.state != "stopping":
            wait_ready(record.address, timeout, curve)
            return record.address
    if not auto_start:
        raise DaemonNotRunningError(
            f"no minisgl daemon is serving {model!r}: start one with `minisgl serve --model {model}` "
            "(or use auto_start=True)"
        )
    check_model_name(model, running_models)  # a name that resolves to nothing fails here: no daemon, log or lock file
    return _start_locked(config, default_address(config), timeout)


def _start_locked(config: EngineConfig, address: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    lock = FileLock(runtime_dir() / f"{daemon_name(config)}.start.lock")
    lock.acquire(timeout)
    try:
        pong = ping(address)
        if pong is not None and pong.state != "stopping":
            wait_ready(address, max(0.0, deadline - time.monotonic()))
        else:
            start_daemon(config, address, max(0.0, deadline - time.monotonic()))
    finally:
        lock.release()
    return address


def stop_daemon(address: str, timeout: float = 30.0, curve: ClientCurve | None = None) -> bool:
    """Ask the daemon at address to shut down (SIGTERM to its registered pid if it does not answer);
    wait until it is gone. False when nothing was running there."""
    record = Registry().get(address)
    pid = record.pid if record is not None and record.alive else None
    if pid is None and ping(address, PING_TIMEOUT_S, curve) is None:
        return False
    try:
        _request(address, Shutdown(uuid.uuid4().hex, "minisgl stop"), PING_TIMEOUT_S, curve)
    except (DaemonTimeoutError, DaemonNotRunningError):
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = not pid_alive(pid) if pid is not None else ping(address, 0.5, curve) is None
        if gone:
            return True
        time.sleep(0.1)
    raise DaemonTimeoutError(f"the daemon at {address} did not stop within {timeout:.0f}s (pid {pid})")


def running_daemons() -> list[Any]:
    """The registered daemons that are alive; what dead ones left (entries, sockets, locks, private directories) is
    removed on the way."""
    records = Registry().records()
    remove_stale_private_dirs()
    return records


def daemon_status(record: Any, curve: ClientCurve | None = None, timeout: float = PING_TIMEOUT_S) -> dict[str, Any]:
    """What `minisgl ps` shows of a registered daemon: its record, its state as it answers a ping
    ("starting", "ready", "stopping", or "not answering" / "refused: ..." when it cannot say), and,
    when ready, its scheduler's load (running and waiting requests, KV pages in use and cached)."""
    status: dict[str, Any] = dict(
        address=record.address,
        model=record.model,
        pid=record.pid,
        uptime_s=round(time.time() - record.started_at),
        state="not answering",
    )
    try:
        pong = ping(record.address, timeout, curve)
        if pong is not None:
            status["state"] = pong.state
        if pong is not None and pong.state == "ready":
            reply = _request(record.address, GetStats(uuid.uuid4().hex), timeout, curve)
            if isinstance(reply, StatsReply):
                status.update({k: v for k, v in reply.stats.items() if k not in status})
    except DaemonTimeoutError:
        pass
    except (DaemonError, ConfigError) as e:  # a CURVE daemon without our key, or its keys we cannot read
        status["state"] = f"refused: {e}"
    return status
