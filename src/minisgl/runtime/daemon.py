"""The daemon process: the frontend ROUTER, the worker processes it starts, start-up and shutdown.

    clients ──DEALER──▶ ROUTER (this process) ──▶ text worker ──▶ scheduler = TP rank 0 (──▶ ranks 1..N-1)
                           ▲                         (tokenize)         │
                           └──────── frontend PULL ◀── text worker ◀───┘
                                                     (detokenize)

The frontend remembers which client (ZMQ identity) owns each request id and routes every
reply back to it. A reply that cannot be routed (the client's connection is gone) aborts all of
that client's requests, so the scheduler frees their pages. The HTTP server, a child process, connects
through a ROUTER of its own: when it dies, its requests are aborted and it is started again (supervisor.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import zmq

from minisgl import __version__
from minisgl.config import EngineConfig
from minisgl.errors import ConfigError, DaemonError, MiniSGLError
from minisgl.runtime.addresses import Address, default_address, parse_address
from minisgl.runtime.auth import ServerCurve, curve_dir, ensure_local_client_keys
from minisgl.runtime.protocol import (
    CLIENT_MESSAGES,
    STARTUP_FAILED,
    Abort,
    Chunk,
    Chunks,
    Detokenize,
    DetokenizeReply,
    Error,
    FlushCache,
    Generate,
    GetModelInfo,
    GetStats,
    Message,
    ModelInfoReply,
    Ping,
    Pong,
    ProtocolError,
    SchedulerReady,
    Shutdown,
    StatsReply,
    Tokenize,
    TokenizeReply,
    WorkerFailed,
    WorkerReady,
    decode,
    encode,
    error_reply,
)
from minisgl.runtime.registry import DaemonRecord, FileLock, Registry
from minisgl.runtime.scheduler_worker import run_scheduler
from minisgl.runtime.supervisor import HttpChild, HttpServer
from minisgl.runtime.text_worker import run_text_worker
from minisgl.runtime.transport import Endpoints, PrivateDir, pull, push, remove_stale_private_dirs, router_socket

logger = logging.getLogger("minisgl")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
STOP_GRACE_S = 5.0  # after Shutdown is sent, how long workers get to exit before they are terminated
FAILED_STOP_GRACE_S = 1.0  # the same after a worker failed (the Shutdown pipeline may be broken)
WORKERS = ("text",)  # besides the scheduler
Peer = tuple[zmq.Socket, bytes]  # a client: the ROUTER it came through, its identity there


class Daemon:
    """Serve one model at one address until SIGTERM/SIGINT, a Shutdown message or a worker failure."""

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        *,
        allow_remote: bool = False,
        curve: bool = False,
        curve_keys: str | os.PathLike | None = None,
        http: HttpServer | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        log_level: int = logging.INFO,
        idle_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.address: Address = parse_address(address or default_address(config))
        if not self.address.is_loopback and not allow_remote:
            raise ConfigError(
                f"{self.address.url} can be reached from other machines: pass --allow-remote to bind it "
                "(clients then need CURVE keys), or bind tcp://127.0.0.1:PORT"
            )
        # Every tcp daemon: any local user can reach a loopback port; an ipc socket is the user's own (0600).
        self.curve_dir = Path(curve_keys) if curve_keys else curve_dir()
        if self.address.scheme == "tcp":
            ensure_local_client_keys(self.curve_dir)  # its own user's clients find them through the registry
        needs_curve = curve or self.address.scheme == "tcp"
        self.curve = ServerCurve(self.curve_dir, remote=not self.address.is_loopback) if needs_curve else None
        self.http = http
        self.max_message_bytes = max_message_bytes
        self.log_level = log_level
        self.registry = Registry()

        self.state = "starting"  # -> "ready" -> "stopping"
        self.exit_code = 0
        self.startup_error: tuple[str, str] | None = None  # (error type, message) of a failed start-up
        self.inflight: dict[str, Peer] = {}  # rid -> the client that sent it
        self.pending: list[tuple[Peer, Message, bytes]] = []  # requests that arrived during start-up
        self.ready_workers: set[str] = set()
        self.model_info: dict[str, Any] = {}
        self.children: dict[str, multiprocessing.process.BaseProcess] = {}
        self.watched: dict[int, multiprocessing.process.BaseProcess] = {}  # sentinel fd -> running child
        self.poller = zmq.Poller()
        self.http_child: HttpChild | None = None
        self.started = time.monotonic()
        self.idle_timeout = idle_timeout  # seconds without a request in flight or arriving, then stop
        self.last_active = self.started
        self.stop_deadline = 0.0
        self._lock: FileLock | None = None
        self._private: PrivateDir | None = None
        self._ctx: zmq.Context | None = None
        self._signal = 0

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Serve until stopped; returns the process exit code (0: asked to stop, 1: a failure)."""
        self.registry.records()  # removes what dead daemons left (entries, sockets, locks)
        remove_stale_private_dirs()
        self._lock = self.registry.claim(self.address)
        wake_r, wake_w = socket.socketpair()  # a signal wakes the event loop through this pair
        for sock in (wake_r, wake_w):
            sock.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._bind()
            keys = str(self.curve_dir) if self.curve is not None and self.address.scheme == "tcp" else None
            record = DaemonRecord(
                self.address.url, self.config.model, os.getpid(), self.config.to_dict(), time.time(), keys
            )
            self.registry.add(record)
            self._spawn_workers()
            self._loop(wake_r)
        finally:
            self._cleanup()
            signal.set_wakeup_fd(old_wakeup)
            for s, handler in old_handlers.items():
                signal.signal(s, handler)
            wake_r.close()
            wake_w.close()
        logger.info("stopped")
        return self.exit_code

    def _bind(self) -> None:
        self._private = PrivateDir()
        self.endpoints = Endpoints.in_dir(self._private.path)
        self._ctx = ctx = zmq.Context()
        self.inbox = pull(ctx, self.endpoints.frontend)
        self.tokenizer = push(ctx, self.endpoints.tokenizer)
        self.local = router_socket(ctx, self.max_message_bytes)  # in-daemon clients (HTTP server): no CURVE
        self.local.bind(self.endpoints.router)
        router = self.router = router_socket(ctx, self.max_message_bytes)
        if self.address.scheme == "tcp":
            router.heartbeat_ivl, router.heartbeat_timeout = 5000, 15000  # notice vanished remote peers
        if self.curve is not None:
            self.curve.apply(ctx, router)
        try:
            if self.address.scheme == "ipc":
                old_umask = os.umask(0o177)
                try:
                    router.bind(self.address.url)
                finally:
                    os.umask(old_umask)
                os.chmod(self.address.path or "", 0o600)
            else:
                router.bind(self.address.url)
        except zmq.ZMQError as e:
            raise DaemonError(
                f"cannot bind {self.address.url}: {e.strerror}; if another daemon listens there, stop it "
                f"(`minisgl stop --address {self.address.url}`) or pick another address"
            ) from e
        auth = " with CURVE authentication" if self.curve is not None else ""
        logger.info("listening at %s%s; starting %s", self.address.url, auth, self.config.model)

    def _spawn_workers(self) -> None:
        mp = multiprocessing.get_context("spawn")
        # With tp > 1 the scheduler process is rank 0 and starts the other ranks itself.
        args = (self.config, self.endpoints, self.log_level)
        self._start(mp.Process(target=run_scheduler, args=args, name="scheduler"))
        self._start(mp.Process(target=run_text_worker, args=(self.endpoints, self.log_level), name="text"))

    def _start(self, proc: multiprocessing.process.BaseProcess) -> None:
        old = self.children.get(proc.name)
        if old is not None and old.exitcode is not None:
            old.close()  # a restarted child's predecessor: its sentinel is no longer watched
        proc.start()
        self.children[proc.name] = proc
        self.watched[proc.sentinel] = proc
        self.poller.register(proc.sentinel, zmq.POLLIN)

    def _loop(self, wake_r: socket.socket) -> None:
        poller = self.poller
        for sock in (self.router, self.local, self.inbox):
            poller.register(sock, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        while True:
            events = dict(poller.poll(200))
            if wake_r.fileno() in events:
                while True:
                    try:
                        wake_r.recv(64)
                    except BlockingIOError:
                        break
            if self._signal:
                name = signal.Signals(self._signal).name
                self._signal = 0
                self.stop(f"received {name}", "RequestAbortedError", f"the daemon is shutting down ({name})")
            if self.inbox in events:
                self._drain(self.inbox, self._on_internal)
            for sock in (self.router, self.local):
                if sock in events:
                    self._drain(sock, lambda ident, *frames, sock=sock: self._on_client((sock, ident), *frames))
            for fd in [fd for fd in self.watched if fd in events]:
                poller.unregister(fd)
                self._on_child_exit(self.watched.pop(fd))
            if self.http_child is not None and self.state == "ready":
                self.http_child.poll()
            self._check_idle()
            if self.state == "stopping" and self._stopped():
                return

    def _check_idle(self) -> None:
        now = time.monotonic()
        if self.inflight or self.pending or self.state != "ready":
            self.last_active = now
        elif self.idle_timeout and now - self.last_active > self.idle_timeout:
            self.stop(f"idle for {self.idle_timeout:g}s (--idle-timeout)", "RequestAbortedError", "the daemon is idle")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum

    def _drain(self, sock: zmq.Socket, handle: Any, limit: int = 1024) -> None:
        for _ in range(limit):  # bounded, so one busy socket cannot starve the other
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(*frames)

    def stop(self, reason: str, error_type: str, message: str, exit_code: int = 0) -> None:
        """Begin shutdown: fail every request in flight, tell the workers to exit."""
        if self.state == "stopping":
            return
        logger.info("stopping: %s", reason)
        self.state = "stopping"
        self.exit_code = exit_code
        for rid, peer in list(self.inflight.items()):
            self._reply(peer, Error(rid, error_type, message))
        for peer, msg, _ in self.pending:
            self._reply(peer, Error(msg.rid, error_type, message))  # type: ignore[union-attr]
        self.inflight.clear()
        self.pending.clear()
        self.tokenizer.send(encode(Shutdown("", reason)))
        if self.http_child is not None:
            self.http_child.cancel()
        if "http" in self.children and self.children["http"].exitcode is None:
            self.children["http"].terminate()  # after the error replies: its open streams end with them
        self.stop_deadline = time.monotonic() + (STOP_GRACE_S if exit_code == 0 else FAILED_STOP_GRACE_S)

    def _stopped(self) -> bool:
        alive = [p for p in self.children.values() if p.is_alive()]
        if not alive:
            return True
        if time.monotonic() < self.stop_deadline:
            return False
        for proc in alive:
            logger.warning("%s (pid %s) did not exit in time; terminating it", proc.name, proc.pid)
            proc.terminate()
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        return True

    def _cleanup(self) -> None:
        if self.curve is not None:
            self.curve.stop()
        if self._ctx is not None:
            for sock in (self.router, self.local, self.inbox, self.tokenizer):
                sock.close()
            self._ctx.term()
        for proc in self.children.values():
            if proc.is_alive():
                proc.kill()
            proc.join(1)
        self.registry.release(self.address, self._lock)
        if self._private is not None:
            self._private.remove()

    # ------------------------------------------------------------------ messages

    def _reply(self, peer: Peer, msg: Message) -> None:
        sock, ident = peer
        try:
            sock.send_multipart([ident, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._client_gone(lambda owner: owner == peer)

    def _client_gone(self, owns: Any) -> int:
        """Abort the requests of the clients that are gone (owns(peer) says which); how many there were."""
        rids = [rid for rid, owner in self.inflight.items() if owns(owner)]
        for rid in rids:
            del self.inflight[rid]
            self.tokenizer.send(encode(Abort(rid)))
        if rids:
            logger.info("a client disconnected; aborted its %d request(s)", len(rids))
        return len(rids)

    def _on_client(self, peer: Peer, *frames: bytes) -> None:
        self.last_active = time.monotonic()
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame per message, got {len(frames)}")
            msg = decode(frames[0])
            if not isinstance(msg, CLIENT_MESSAGES):
                raise ProtocolError(f"a client cannot send {type(msg).TAG!r} messages")  # type: ignore[union-attr]
            if not isinstance(msg.rid, str) or not msg.rid:
                raise ProtocolError("every request needs a non-empty string rid")
        except ProtocolError as e:
            self._reply(peer, error_reply("", e))
            return
        if isinstance(msg, Ping):
            self._reply(peer, self._pong(msg.rid))
        elif isinstance(msg, Shutdown):
            self._reply(peer, self._pong(msg.rid)._replace(state="stopping"))
            self.stop(
                f"a client asked ({msg.reason})", "RequestAbortedError", "the daemon is shutting down (minisgl stop)"
            )
        elif self.state == "stopping":
            self._reply(peer, Error(msg.rid, "DaemonNotRunningError", "the daemon is shutting down"))
        elif self.state == "starting":
            self.pending.append((peer, msg, frames[0]))
        else:
            self._dispatch(peer, msg, frames[0])

    def _dispatch(self, peer: Peer, msg: Message, raw: bytes) -> None:
        if isinstance(msg, GetModelInfo):
            self._reply(peer, ModelInfoReply(msg.rid, self.model_info))
        elif isinstance(msg, Abort):
            if self.inflight.get(msg.rid) == peer:  # a client aborts its own requests only
                self.tokenizer.send(raw)
        elif isinstance(msg, (Generate, GetStats, FlushCache, Tokenize, Detokenize)):
            if msg.rid in self.inflight:
                self._reply(peer, Error(msg.rid, "InvalidRequestError", f"request id {msg.rid!r} is already in flight"))
                return
            self.inflight[msg.rid] = peer
            self.tokenizer.send(raw)

    def _pong(self, rid: str) -> Pong:
        return Pong(
            rid, self.state, os.getpid(), self.config.model, self.address.url, __version__, self.config.to_dict()
        )

    def _on_internal(self, raw: bytes) -> None:
        msg = decode(raw)
        if isinstance(msg, Chunks):
            self._route_chunks(msg.items)
        elif isinstance(msg, Error):
            peer = self.inflight.pop(msg.rid, None)
            if peer is not None:
                self._reply(peer, msg)
                self.tokenizer.send(encode(Abort(msg.rid)))  # the request's other samples, if any
        elif isinstance(msg, (TokenizeReply, DetokenizeReply)):
            peer = self.inflight.pop(msg.rid, None)
            if peer is not None:
                self._reply(peer, msg)
        elif isinstance(msg, StatsReply):
            peer = self.inflight.pop(msg.rid, None)
            if peer is not None:
                stats = {
                    **msg.stats,
                    "inflight": len(self.inflight),
                    "uptime_s": time.monotonic() - self.started,
                    "workers": {name: proc.pid for name, proc in self.children.items()},
                }
                self._reply(peer, msg._replace(stats=stats))
        elif isinstance(msg, SchedulerReady):
            self.model_info = msg.model_info
            stats = msg.stats
            logger.info(
                "scheduler ready: %s (%s), context %d tokens, KV pool %d pages x %d tokens",
                self.config.model,
                msg.model_info["architecture"],
                msg.model_info["context_length"],
                stats["total_pages"],
                msg.model_info.get("page_size"),
            )
            self._on_ready("scheduler")
        elif isinstance(msg, WorkerReady):
            self._on_ready(msg.worker)
        elif isinstance(msg, WorkerFailed):
            text = f"{msg.worker} failed: {msg.error_type}: {msg.message}"
            logger.error(text)
            if self.state == "starting":
                self.startup_error = (msg.error_type, msg.message)
            self.stop(text, "DaemonError", f"the daemon stopped because its {text}", exit_code=1)

    def _route_chunks(self, chunks: list[Chunk]) -> None:
        by_client: dict[Peer, list[Chunk]] = defaultdict(list)
        for chunk in chunks:
            peer = self.inflight.get(chunk.rid)
            if peer is None:
                continue  # aborted, or its client is gone
            if chunk.done:
                del self.inflight[chunk.rid]
            by_client[peer].append(chunk)
        for peer, items in by_client.items():
            self._reply(peer, Chunks(items))

    def _on_ready(self, worker: str) -> None:
        self.ready_workers.add(worker)
        if self.state != "starting" or not {"scheduler", *WORKERS} <= self.ready_workers:
            return
        self.state = "ready"
        if self.http is not None:
            args = (self.endpoints.router, self.config.model, self.log_level)
            self.http_child = HttpChild(self.http, args, self._start)
            self.http_child.start()
            logger.info("HTTP server starting on %s", self.http_child.url)
        logger.info(
            "ready: serving %s at %s (start-up %.1fs)",
            self.config.model,
            self.address.url,
            time.monotonic() - self.started,
        )
        pending, self.pending = self.pending, []
        for peer, msg, raw in pending:
            self._dispatch(peer, msg, raw)

    def _on_child_exit(self, proc: multiprocessing.process.BaseProcess) -> None:
        proc.join(1)  # its sentinel fires as it exits; the exit code follows a moment later
        if self.state == "stopping":
            logger.debug("%s (pid %s) exited with code %s", proc.name, proc.pid, proc.exitcode)
            return
        if proc.name == "http" and self.http_child is not None:
            aborted = self._client_gone(lambda owner: owner[0] is self.local)  # only that process used self.local
            reason = self.http_child.exited(proc, aborted)
            if reason is not None:
                logger.error("%s; stopping the daemon", reason)
                self.stop(reason, "DaemonError", f"the daemon stopped because {reason}", exit_code=1)
            return
        text = f"{proc.name} process (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}"
        logger.error(text)
        self.stop(text, "DaemonError", f"the daemon stopped because its {text}", exit_code=1)


def serve(config: EngineConfig, address: str | None = None, **options: Any) -> int:
    """Run a daemon in this process (what `minisgl serve` does); returns the exit code.

    A daemon that cannot start ends its output with a STARTUP_FAILED line (the error's type and
    message as JSON), so a client that auto-started it raises the same typed error.
    """
    try:
        daemon = Daemon(config, address, **options)
        code = daemon.run()
        failure = daemon.startup_error
    except MiniSGLError as e:
        logger.error("%s", e)
        code, failure = 1, (type(e).__name__, str(e))
    if failure is not None:
        print(
            STARTUP_FAILED + json.dumps({"error_type": failure[0], "message": failure[1]}), file=sys.stderr, flush=True
        )
    return code
