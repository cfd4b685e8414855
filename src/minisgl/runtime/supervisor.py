"""The daemon's watch over its HTTP server process: one that exits is started again on the same port, after a delay
that grows while it keeps failing; one that keeps failing soon after its start stops the daemon (loudly) rather
than looping forever. ZeroMQ clients are served all along: only the HTTP process's own requests are lost."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import time
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

logger = logging.getLogger("minisgl")

RESTART_DELAYS_S = (0.5, 1.0, 2.0)  # before the first, second, ... restart in a row; one more failure gives up
STABLE_S = 30.0  # a run this long was a healthy one: its exit starts the count of failures again


class Restarts:
    """When to start an exited process again: after delays[k] once it failed k+1 times in a row (a run shorter than
    stable_s is a failure; a longer one ends the row), and never once a failure has no delay left."""

    def __init__(self, delays: tuple[float, ...] = RESTART_DELAYS_S, stable_s: float = STABLE_S) -> None:
        self.delays = delays
        self.stable_s = stable_s
        self.failures = 0  # short runs in a row

    def after_exit(self, ran_s: float) -> float | None:
        """Seconds to wait before the next start of a process that ran ran_s seconds, or None: give up."""
        self.failures = 1 if ran_s >= self.stable_s else self.failures + 1
        return self.delays[self.failures - 1] if self.failures <= len(self.delays) else None


def port_taken(host: str, port: int) -> str | None:
    """None when this process could bind host:port (then releases it); else a sentence naming the port and, where
    this user may see it, the process listening on it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
        try:
            sock.bind((host, port))
            return None
        except OSError as e:
            why = e.strerror or str(e)
    return f"HTTP port {port} on {host} is taken ({why}): {port_holder(port)}"


def port_holder(port: int) -> str:
    """Who listens on a local TCP port: "held by NAME (pid N)", or that another user's process (invisible to this
    one) holds it."""
    try:
        import psutil  # lazy: psutil is optional

        holders = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid}
        names = []
        for pid in sorted(holders):
            try:
                names.append(f"{psutil.Process(pid).name()} (pid {pid})")
            except psutil.Error:
                names.append(f"pid {pid}")
    except Exception:  # psutil missing, or /proc unreadable: say what we know
        names = []
    if names:
        return "held by " + ", ".join(names)
    return "held by a process this user cannot see (another user's, or in another network namespace)"


class HttpServer(Protocol):
    """The HTTP server a daemon starts, handed down by the CLI (minisgl.server.HttpOptions: the runtime sits below
    its front ends and never imports them)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    def run(self, address: str, model: str, log_level: int) -> None:
        """Process entry of the HTTP server: one more client of the daemon at address."""


class HttpChild:
    """The daemon's HTTP server process (HttpServer.run in a spawned process named "http"), restarted by Restarts.

    spawn starts a process and makes it the daemon's child of its name (the daemon watches its exit)."""

    def __init__(
        self, options: HttpServer, args: tuple, spawn: Callable[[BaseProcess], None], restarts: Restarts | None = None
    ) -> None:
        self.options = options
        self.args = args  # (daemon address, model, log level), as HttpServer.run takes them
        self._spawn = spawn
        self.restarts = restarts or Restarts()
        self.started_at = 0.0
        self.due: float | None = None  # time.monotonic() of the restart waiting, if any

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def start(self) -> None:
        mp = multiprocessing.get_context("spawn")
        # The front end brings its own process entry: the runtime never imports the server.
        self._spawn(mp.Process(target=self.options.run, args=self.args, name="http"))
        self.started_at = time.monotonic()

    def exited(self, proc: BaseProcess, aborted: int) -> str | None:
        """After the process exited (its aborted requests counted): schedule its restart and say so; the reason to
        stop the daemon when it keeps failing."""
        ran = time.monotonic() - self.started_at
        what = f"the HTTP server process (pid {proc.pid}) exited with code {proc.exitcode} after {ran:.1f}s"
        if proc.exitcode and (taken := port_taken(self.options.host, self.options.port)) is not None:
            return f"{what}: {taken} (stop it, or give `minisgl serve` another --http-port, or --no-http)"
        delay = self.restarts.after_exit(ran)
        if delay is None:
            return (
                f"{what}: it failed {self.restarts.failures} times in a row, each within {self.restarts.stable_s:g}s "
                f"of its start; its errors are logged above (is {self.url} taken by another process?)"
            )
        self.due = time.monotonic() + delay
        logger.error(
            "%s; %d of its requests were aborted; starting it again on %s in %gs (restart %d of at most %d in a row)",
            what,
            aborted,
            self.url,
            delay,
            self.restarts.failures,
            len(self.restarts.delays),
        )
        return None

    def poll(self) -> None:
        """Start the process again if its restart is due."""
        if self.due is not None and time.monotonic() >= self.due:
            self.due = None
            self.start()
            logger.info("HTTP server starting again on %s", self.url)

    def cancel(self) -> None:
        """No restart any more (the daemon is stopping)."""
        self.due = None
