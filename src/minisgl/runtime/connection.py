"""A client's link to a daemon: one DEALER socket whose replies are sorted into per-request inboxes.

The socket is watched through a ZMQ monitor, so requests waiting on a daemon that dies (or that
refuses the client's CURVE keys) fail at once instead of waiting out their timeout, and so do the
requests made while the connection is down; ZMQ reconnects on its own when the daemon is back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Union

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from minisgl.errors import DaemonError, DaemonNotRunningError, DaemonTimeoutError, InvalidRequestError
from minisgl.runtime.auth import ClientCurve, registered_curve
from minisgl.runtime.protocol import Abort, Chunk, Chunks, Error, Message, ProtocolError, decode, encode, error_class

logger = logging.getLogger("minisgl")

Reply = Union[Chunk, Message]  # what one request's inbox receives: its Chunks one by one, or a reply

_WATCHED = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
CLOSED = "the client was closed while this request was in flight"
IS_CLOSED = "this client is closed: make a new one"
# A request made while the connection is down waits this long for ZMQ to reconnect (it retries every 0.1 s)
# before it fails: a daemon that is back by then serves it.
RECONNECT_WAIT_S = 1.0


def _socket(ctx: zmq.Context, address: str, curve: ClientCurve | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0  # never block a sender: requests queue while the daemon starts
    curve = curve or registered_curve(address)  # a tcp daemon of this host: its user's local keys
    if curve is not None:
        curve.apply(sock)
    if address.startswith("tcp://"):
        sock.heartbeat_ivl, sock.heartbeat_timeout = 5000, 15000
    return sock


def _monitor(sock: zmq.Socket) -> zmq.Socket:
    """The socket's monitor. Its inproc name is unique: pyzmq's default names it after the socket's file
    descriptor, and libzmq unbinds a stopped monitor asynchronously, so a new socket that reuses a just-closed
    descriptor could fail with "Address already in use"."""
    return sock.get_monitor_socket(_WATCHED, addr=f"inproc://minisgl.monitor.{uuid.uuid4().hex}")


def _event_error(address: str, event: dict[str, Any]) -> Error | None:
    kind = event["event"]
    if kind == zmq.EVENT_DISCONNECTED:
        return Error("", "DaemonNotRunningError", f"the connection to the daemon at {address} was lost (did it stop?)")
    if kind & (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    ):
        return Error(
            "",
            "DaemonError",
            f"the daemon at {address} refused the connection (CURVE handshake failed): give the client its "
            "keypair file and the server's public key (curve_client_key=/curve_server_key= or "
            "$MINISGL_CURVE_CLIENT_KEY/$MINISGL_CURVE_SERVER_KEY), authorized on the daemon",
        )
    return None


class _Link:
    """Whether the socket is connected, as its monitor's events (read in order) tell."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lost = False  # the client found the daemon ready just before connecting: assume connected

    def on_event(self, event: dict[str, Any]) -> Error | None:
        """Follow one monitor event; the error it means for the requests waiting now, if any."""
        if event["event"] == zmq.EVENT_CONNECTED:
            self.lost = False
            return None
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.lost = True
        return _event_error(self.address, event)

    def check(self) -> None:
        """Refuse a new request while the connection is down (it would wait out its timeout otherwise)."""
        if self.lost:
            raise DaemonNotRunningError(
                f"no minisgl daemon answers at {self.address}: the connection was lost (did it stop?); "
                "start it again and retry (the client reconnects by itself)"
            )


def _closed_send(msg: Message) -> None:
    """A message sent on a closed connection: an Abort is moot (the daemon aborts the requests of a connection
    that is gone), anything else a DaemonError."""
    if not isinstance(msg, Abort):
        raise DaemonError(IS_CLOSED)


class _Inboxes:
    """Replies sorted by request id; replies for ids nobody waits on (any more) are dropped."""

    def __init__(self) -> None:
        self.boxes: dict[str, Any] = {}

    def claim(self, rid: str, box: Any) -> None:
        """Give rid its inbox; a rid already waiting here is refused (InvalidRequestError) and keeps its own: taking
        it over left that request's replies without a reader (it hung until its timeout)."""
        if rid in self.boxes:
            raise InvalidRequestError(f"request id {rid!r} is already in flight: give each request its own id")
        self.boxes[rid] = box

    def route(self, msg: Message) -> list[tuple[Any, Reply]]:
        # .get: a stream may be forgotten from another thread (garbage collection) meanwhile.
        if isinstance(msg, Chunks):
            pairs = [(self.boxes.get(c.rid), c) for c in msg.items]
            return [(box, c) for box, c in pairs if box is not None]
        rid = getattr(msg, "rid", "")
        box = self.boxes.get(rid)
        if box is not None:
            return [(box, msg)]
        if isinstance(msg, Error) and not rid:  # about the connection itself: everyone waiting hears it
            return [(box, msg) for box in list(self.boxes.values())]
        return []


class _Connection(ABC):
    """What both connections are: a DEALER socket with its monitor, the inboxes of the requests in flight and the
    link's state; subclasses say how an inbox is made, filled and waited on."""

    def __init__(self, ctx: zmq.Context, address: str, curve: ClientCurve | None) -> None:
        self.address = address
        self.sock = _socket(ctx, address, curve)
        self.monitor = _monitor(self.sock)
        self.sock.connect(address)
        self.inboxes = _Inboxes()
        self.link = _Link(address)

    def forget(self, rid: str) -> None:
        self.inboxes.boxes.pop(rid, None)

    def send(self, msg: Message) -> None:
        """Send without waiting (safe in a finally block of a cancelled task)."""
        if self.sock.closed:
            _closed_send(msg)
            return
        self.sock.send(encode(msg))

    def _deliver(self, msg: Message) -> None:
        for box, reply in self.inboxes.route(msg):
            self._put(box, reply)

    @abstractmethod
    def _put(self, box: Any, reply: Reply) -> None:
        """Hand reply to the request waiting on box."""

    def _timed_out(self, timeout: float) -> DaemonTimeoutError:
        return DaemonTimeoutError(f"no reply from the daemon at {self.address} within {timeout:.1f}s")

    def _close_sockets(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class SyncConnection(_Connection):
    """Blocking; used by one thread at a time (the sync Client keeps one per thread), closed from any thread.

    A ZMQ socket must not be closed while another thread polls it (libzmq may crash), so close() from another
    thread only wakes the reader (a pipe in its poller), which closes the sockets itself and fails its request.
    """

    def __init__(self, ctx: zmq.Context, address: str, curve: ClientCurve | None = None) -> None:
        super().__init__(ctx, address, curve)
        self._wake_r, self._wake_w = os.pipe()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._reading = threading.Lock()  # held while the owning thread waits in next()
        self._state = threading.RLock()  # guards _closing and the pipe (re-entered by a finalizer's close)
        self._closing = False

    def open(self, rid: str) -> None:
        """Register a request about to be sent; DaemonNotRunningError when the connection is down and stays
        down for RECONNECT_WAIT_S."""
        if self.sock.closed:
            raise DaemonError(IS_CLOSED)
        self._events()  # events that came while nobody waited concern the requests before this one
        deadline = _now() + RECONNECT_WAIT_S
        while self.link.lost and self.monitor.poll(max(0, int((deadline - _now()) * 1000))):
            self._events()
        self.link.check()
        self.inboxes.claim(rid, deque())

    def next(self, rid: str, timeout: float | None) -> Reply:
        """The next reply for rid (opened before its request was sent); DaemonTimeoutError after timeout s."""
        box: deque = self.inboxes.boxes[rid]
        with self._reading:
            return self._next(box, timeout)

    def _next(self, box: deque, timeout: float | None) -> Reply:
        deadline = None if timeout is None else _now() + timeout
        while not box:
            if self._closing or self.sock.closed:  # close() was asked by another thread (Client.close)
                self._close_now()
                raise DaemonError(CLOSED)
            wait_ms = None if deadline is None else max(0, int((deadline - _now()) * 1000))
            events = dict(self.poller.poll(wait_ms))
            if self._wake_r in events:
                continue  # the loop's head closes
            if self.sock in events:
                self._drain()
            elif self.monitor in events:
                self._drain()  # replies that arrived before the event come first
                self._events()
            elif deadline is not None and _now() >= deadline:
                raise self._timed_out(timeout)  # type: ignore[arg-type]
        return box.popleft()

    def _put(self, box: deque, reply: Reply) -> None:
        box.append(reply)

    def _drain(self) -> None:
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(_decode_reply(raw))

    def _events(self) -> None:
        """Follow the monitor's waiting events; a lost connection fails the requests waiting now."""
        while self.monitor.poll(0):
            error = self.link.on_event(recv_monitor_message(self.monitor))
            if error is not None:
                self._deliver(error)

    def close(self) -> None:
        """Close now, or, while another thread waits in next(), have that thread close on waking."""
        with self._state:
            if self._closing:
                return
            self._closing = True
        if self._reading.acquire(blocking=False):
            try:
                self._close_now()
            finally:
                self._reading.release()
        else:
            with self._state:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"x")

    def _close_now(self) -> None:
        with self._state:
            self._closing = True
            if not self.sock.closed:
                self._close_sockets()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1


class AsyncConnection(_Connection):
    """asyncio: one reader task feeds per-request queues, so any number of requests share the socket."""

    def __init__(self, address: str, curve: ClientCurve | None = None) -> None:
        super().__init__(zmq.asyncio.Context.instance(), address, curve)
        self._connected = asyncio.Event()
        self._connected.set()
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    async def open(self, rid: str) -> None:
        """Register a request about to be sent; DaemonNotRunningError when the connection is down and stays
        down for RECONNECT_WAIT_S."""
        if self.link.lost:
            try:
                await asyncio.wait_for(self._connected.wait(), RECONNECT_WAIT_S)
            except asyncio.TimeoutError:
                pass
        if self.sock.closed:
            raise DaemonError(IS_CLOSED)
        self.link.check()
        self.inboxes.claim(rid, asyncio.Queue())

    async def next(self, rid: str, timeout: float | None) -> Reply:
        box: asyncio.Queue = self.inboxes.boxes[rid]
        if not box.empty() or timeout is None:
            return await box.get()
        try:
            return await asyncio.wait_for(box.get(), timeout)
        except asyncio.TimeoutError:
            raise self._timed_out(timeout) from None

    def _put(self, box: asyncio.Queue, reply: Reply) -> None:
        box.put_nowait(reply)

    async def _read(self) -> None:
        while True:
            self._deliver(_decode_reply(await self.sock.recv()))

    async def _watch(self) -> None:
        while True:
            frames = await self.monitor.recv_multipart()
            error = self.link.on_event(parse_monitor_message(frames))
            (self._connected.clear if self.link.lost else self._connected.set)()
            if error is not None:
                await asyncio.sleep(0)  # let the reader hand out replies that arrived before the event
                self._deliver(error)

    async def close(self) -> None:
        self._deliver(Error("", "DaemonError", CLOSED))  # requests still read fail now
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()


def _decode_reply(raw: bytes) -> Message:
    try:
        return decode(raw)
    except ProtocolError as e:
        logger.warning("unreadable reply from the daemon: %s", e)
        return Error("", "ProtocolError", f"unreadable reply from the daemon: {e}")


def _now() -> float:
    return time.monotonic()


def as_exception(reply: Error) -> Exception:
    """The typed exception an Error reply stands for."""
    return error_class(reply.error_type)(reply.message)
