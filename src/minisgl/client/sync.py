"""The blocking Client: one DEALER connection per thread, each request method a blocking drive of its Op."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import zmq

from minisgl.client.core import (
    Call,
    ClientCore,
    Effect,
    Read,
    Requests,
    Send,
    StreamCore,
    run_blocking,
)
from minisgl.errors import DaemonError
from minisgl.runtime.connection import SyncConnection
from minisgl.runtime.protocol import Chunk, Generate


class Stream(StreamCore):
    """Chunks of one request, as they come; close() (or leaving a `with` block / a for loop early) aborts it."""

    def __init__(self, client: "Client", held: _ThreadConnection, rid: str, timeout: float | None) -> None:
        self.rid = rid
        self._client = client
        self._held = held  # keeps the connection open while the stream lives, even past its thread
        self._conn = held.conn
        self._timeout = timeout
        self._open = True

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        if not self._open:
            raise StopIteration
        with self._aborting():
            wait, by_deadline = self._wait()
            with self._within(by_deadline):
                reply = self._conn.next(self.rid, wait)
        return self._chunk(reply)

    def _end(self) -> None:
        self._open = False
        self._conn.forget(self.rid)

    def _abort(self) -> None:
        if self._open:
            self._end()
            self._client.abort(self.rid)

    def close(self) -> None:
        """Abort the request unless it already finished."""
        self._abort()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the client may be closed already at interpreter exit
            pass


def _close_connections(conns: list[SyncConnection], lock: threading.RLock) -> None:
    with lock:
        while conns:
            conns.pop().close()


def _close_connection(conn: SyncConnection, conns: list[SyncConnection], lock: threading.RLock) -> None:
    with lock:
        if conn in conns:  # not closed with the whole Client already
            conns.remove(conn)
            conn.close()


class _ThreadConnection:
    """One thread's connection, closed once the thread has ended (its thread-local slot goes) and no Stream made
    in it is left: a Client shared by short-lived threads holds one socket per live thread, not one per thread
    that ever used it."""

    def __init__(self, conn: SyncConnection, conns: list[SyncConnection], lock: threading.RLock) -> None:
        self.conn = conn
        weakref.finalize(self, _close_connection, conn, conns, lock)


class Client(ClientCore[Stream]):
    """A synchronous client of the daemon serving `model`; safe to share between threads.

    model: a model name/path as `minisgl serve --model` takes it. address: ipc:///path or
    tcp://host:port of a daemon (default: the one serving model, found in the registry of the
    user's runtime dir). auto_start: start a daemon (detached `minisgl serve`) when none runs.
    timeout: seconds to wait for start-up and, per request, for each reply (None: no limit).
    curve_client_key / curve_server_key: key files for a CURVE-protected daemon (see
    minisgl.runtime.auth; also $MINISGL_CURVE_CLIENT_KEY / $MINISGL_CURVE_SERVER_KEY).
    engine_kwargs: EngineConfig options a started daemon gets (and a found one must match).
    """

    def _init_transport(self) -> None:
        self.address = self._locate()
        self._ctx = zmq.Context.instance()
        self._local = threading.local()
        self._lock = threading.RLock()  # reentrant: a connection's finalizer may run in a thread that holds it
        self._conns: list[SyncConnection] = []
        self._closed = False
        # A Client dropped without close() (or alive at exit) still closes its sockets.
        self._finalizer = weakref.finalize(self, _close_connections, self._conns, self._lock)

    generate = run_blocking(Requests.generate)
    embed = run_blocking(Requests.embed)
    abort = run_blocking(Requests.abort)
    model_info = run_blocking(Requests.model_info)
    stats = run_blocking(Requests.stats)
    flush_cache = run_blocking(Requests.flush_cache)
    tokenize = run_blocking(Requests.tokenize)
    detokenize = run_blocking(Requests.detokenize)

    def _thread_connection(self) -> _ThreadConnection:
        if self._closed:
            raise DaemonError("this Client is closed")
        held = getattr(self._local, "conn", None)
        if held is None:
            with self._lock:
                if self._closed:
                    raise DaemonError("this Client is closed")
                conn = SyncConnection(self._ctx, self.address, self.curve)
                self._conns.append(conn)
            held = self._local.conn = _ThreadConnection(conn, self._conns, self._lock)
        return held

    def _open_stream(self, msg: Generate, timeout: float | None) -> Stream:
        held = self._thread_connection()
        held.conn.open(msg.rid)
        held.conn.send(msg)
        return Stream(self, held, msg.rid, timeout)

    def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            conn = self._thread_connection().conn
            conn.open(effect.msg.rid)
            try:
                conn.send(effect.msg)
                return conn.next(effect.msg.rid, self.timeout)
            finally:
                conn.forget(effect.msg.rid)
        if isinstance(effect, Send):
            if not self._closed:  # closing dropped the connection: the daemon aborts its requests itself
                self._thread_connection().conn.send(effect.msg)
            return None
        return self._read(effect)

    def _read(self, effect: Read) -> list[list[Chunk]]:
        """Send every request, then read each stream to its end."""
        streams: list[Stream] = []
        try:
            for msg in effect.msgs:
                streams.append(self._open_stream(msg, effect.timeout))
                streams[-1]._limit(effect.total)
            out = []
            for stream in streams:
                with stream:
                    out.append(list(stream))
            return out
        finally:
            for stream in streams:
                stream.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
