"""The tensor-parallel control channel: rank 0's ops to every rank, and failures both ways, over ZeroMQ.

Nothing of it crosses a socket another local user can reach:
- one host: ipc sockets inside a private (0700) directory that rank 0 creates (`ChannelPlace.private`);
- several hosts: tcp on node 0's address (dist_init_addr's host, ports P+1..P+3), under CURVE. Both keypairs
  derive from the engine's shared secret, so only a holder of the secret connects, and the traffic is encrypted.

Rank 0 binds three sockets; every other rank (and a node's launcher) connects:

    ops      ROUTER -> DEALER "rank-N"   one signed TPOps per step; the rank's signed hello comes back at start
    events   PULL   <- PUSH              a rank's failure or clean exit, a node launcher's report of a rank's death
    control  PUB    -> SUB               rank 0's heartbeat and its failure notice, read by each rank's watch thread

Every message is signed with the secret (distributed/auth.py) and typed msgpack, never pickle: a message that
does not verify is dropped and logged. A socket is used by one thread only (rank 0: ops by the main thread,
events and control by the monitor thread; ranks > 0: ops and events by the main thread, control by the watch).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from minisgl.distributed.auth import sign, verify
from minisgl.lifetime import pid_alive

logger = logging.getLogger("minisgl")

ZAP_DOMAIN = "minisgl-tp"
HELLO = b"minisgl tp hello rank %d"
EVENT_KINDS = ("failed", "exited", "heartbeat")
SOCKETS = ("ops", "events", "control")
PLACE_PREFIX = "minisgl-tp-"  # + rank 0's pid: a channel directory in the temporary directory
LINGER_MS = 2000  # a failure report or exit notice still goes out as its process closes the socket


class ChannelPlace(NamedTuple):
    """Where the channel's sockets are: an ipc directory (one host) or node 0's tcp host and first port."""

    directory: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def private(cls) -> "ChannelPlace":
        """A fresh 0700 directory (mkdtemp's mode) for one host's engine; removed by `remove`. Those of engines
        whose rank 0 died without removing its own (a SIGKILL) are removed first."""
        remove_stale_places()
        path = tempfile.mkdtemp(prefix=f"{PLACE_PREFIX}{os.getpid()}-")
        return cls(directory=path)

    @classmethod
    def of_nodes(cls, dist_init_addr: str) -> "ChannelPlace":
        host, _, port = dist_init_addr.rpartition(":")
        return cls(host=host.strip("[]"), port=int(port))

    @classmethod
    def parse(cls, text: str) -> "ChannelPlace":
        """The inverse of str(): a rank's command line carries its channel's place."""
        kind, _, rest = text.partition(":")
        return cls(directory=rest) if kind == "dir" else cls.of_nodes(rest)

    def __str__(self) -> str:
        return f"dir:{self.directory}" if self.directory else f"tcp:{self.host}:{self.port}"

    @property
    def curve(self) -> bool:
        return self.directory is None

    def endpoint(self, name: str) -> str:
        if self.directory is not None:
            return f"ipc://{Path(self.directory) / name}.ipc"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tcp://{host}:{self.port + 1 + SOCKETS.index(name)}"  # type: ignore[operator]

    def store_path(self) -> str:
        """One host's rendezvous: a FileStore in the private directory (no port for anyone to reach)."""
        assert self.directory is not None
        return str(Path(self.directory) / "store")

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def remove_stale_places() -> None:
    """Remove this user's channel directories whose rank 0 process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{PLACE_PREFIX}*-*"):
        pid = path.name[len(PLACE_PREFIX) :].partition("-")[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid() or pid_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


class TPEvent(NamedTuple):
    """A rank -> rank 0 (events) or rank 0 -> every rank (control) notice."""

    kind: str  # one of EVENT_KINDS
    rank: int  # who sends it (-1: a node's launcher)
    text: str = ""  # a failure's reason

    def pack(self, secret: bytes) -> bytes:
        return sign(secret, msgpack.packb(list(self), use_bin_type=True))

    @classmethod
    def unpack(cls, secret: bytes, blob: bytes) -> "TPEvent | None":
        """The event, or None when it is not signed with the secret or not an event."""
        payload = verify(secret, blob)
        if payload is None:
            return None
        try:
            kind, rank, text = msgpack.unpackb(payload, raw=False)
        except Exception:  # noqa: BLE001 - signed but malformed: still not an event
            return None
        if kind not in EVENT_KINDS or not isinstance(rank, int) or not isinstance(text, str):
            return None
        return cls(kind, rank, text)


# One op: [kind, *fields]; the kinds a rank > 0 applies (runtime/tp.py) and how many fields each has.
TP_OP_FIELDS = {
    "add": 4,
    "compile": 1,
    "abort": 1,
    "reset_prefix_cache": 0,
    "profile": 2,
    "prefill_budget": 1,
    "exit": 0,
    # Within a step, only while a rank > 0's scheduler waits for them (scheduler/speculative.py): rank 0's decisions.
    "may_draft": 1,
    "drafts": 1,
}


class TPOps(NamedTuple):
    """Rank 0 -> every rank > 0: one step's ops, in order; seq counts the steps from 0, so that a replayed or
    reordered message is refused."""

    seq: int
    ops: list[list[Any]]

    def pack(self, secret: bytes) -> bytes:
        return sign(secret, msgpack.packb([self.seq, [list(op) for op in self.ops]], use_bin_type=True))

    @classmethod
    def unpack(cls, secret: bytes, blob: bytes) -> "TPOps | None":
        """The ops, or None when they are not signed with the secret or not a well-formed TPOps."""
        payload = verify(secret, blob)
        if payload is None:
            return None
        try:
            seq, ops = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - signed but malformed: still not ops
            return None
        if not isinstance(seq, int) or not isinstance(ops, list) or not all(map(_is_op, ops)):
            return None
        return cls(seq, ops)


def _is_op(op: Any) -> bool:
    return isinstance(op, list) and bool(op) and TP_OP_FIELDS.get(op[0]) == len(op) - 1


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """A CURVE (public, secret) keypair only a holder of the engine's secret can make."""
    key = zmq.utils.z85.encode(hmac.new(secret, b"minisgl tp curve " + role, hashlib.sha256).digest())
    return zmq.curve_public(key), key


class _Curve:
    """CURVE for the tcp channel: rank 0 is the server and admits only the secret's client key."""

    def __init__(self, secret: bytes) -> None:
        self.server_public, self.server_secret = _keypair(secret, b"server")
        self.client_public, self.client_secret = _keypair(secret, b"client")

    def serve(self, ctx: zmq.Context) -> Any:

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("minisgl.tp.zap"))
        auth.start()
        allowed = self.client_public

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return hmac.compare_digest(key, allowed)

        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Keys())
        return auth

    def server_socket(self, sock: zmq.Socket) -> None:
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_secretkey, sock.curve_publickey = self.server_secret, self.server_public
        sock.curve_server = True

    def client_socket(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey, sock.curve_publickey = self.client_secret, self.client_public
        sock.curve_serverkey = self.server_public


def _socket(ctx: zmq.Context, kind: int, curve: _Curve | None, server: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = LINGER_MS
    if kind in (zmq.ROUTER, zmq.DEALER, zmq.PUSH, zmq.PUB):
        sock.sndhwm = 0  # the ops of a step are never dropped or held back
    if curve is not None:
        (curve.server_socket if server else curve.client_socket)(sock)
    return sock


class Hub:
    """Rank 0's end: binds the three sockets (the monitor thread owns events and control)."""

    def __init__(self, place: ChannelPlace, secret: bytes, world_size: int) -> None:
        self.place, self.secret, self.world_size = place, secret, world_size
        self.ctx = zmq.Context()
        curve = _Curve(secret) if place.curve else None
        self._auth = curve.serve(self.ctx) if curve is not None else None
        self.ops = _socket(self.ctx, zmq.ROUTER, curve, server=True)
        self.ops.router_mandatory = True  # an op for a rank that is not connected raises, never vanishes
        self.events = _socket(self.ctx, zmq.PULL, curve, server=True)
        self.control = _socket(self.ctx, zmq.PUB, curve, server=True)
        for name in SOCKETS:
            getattr(self, name).bind(place.endpoint(name))

    def hello_from(self, timeout_ms: int) -> int | None:
        """The rank whose signed hello arrived within timeout_ms (None: none did, or it was not genuine)."""
        if not self.ops.poll(timeout_ms):
            return None
        frames = self.ops.recv_multipart()
        if len(frames) != 2:
            return None
        ident, blob = frames
        rank = _rank_of(ident)
        if rank is None or verify(self.secret, blob) != HELLO % rank:
            logger.warning("ignored a tensor-parallel hello that does not carry the engine's secret")
            return None
        return rank

    def send_ops(self, payload: bytes) -> None:
        """One signed message (TPOps.pack) to every rank > 0 (never waits for them)."""
        for rank in range(1, self.world_size):
            try:
                self.ops.send_multipart([_identity(rank), payload])
            except zmq.ZMQError as e:  # router_mandatory: the rank's connection is gone (so is the rank)
                raise RuntimeError(f"tensor-parallel rank {rank} is not connected to the control channel") from e

    def events_ready(self, timeout_ms: int) -> list[TPEvent]:
        """The genuine events waiting, after waiting up to timeout_ms for the first one (monitor thread)."""
        out: list[TPEvent] = []
        while self.events.poll(timeout_ms if not out else 0):
            event = TPEvent.unpack(self.secret, self.events.recv())
            if event is None:
                logger.warning("ignored a tensor-parallel event that is not signed with the engine's secret")
                continue
            out.append(event)
            timeout_ms = 0
        return out

    def publish(self, event: TPEvent) -> None:
        self.control.send(event.pack(self.secret))

    def close(self) -> None:
        for name in SOCKETS:
            getattr(self, name).close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


class Spoke:
    """A rank > 0's end (or a node launcher's, with rank -1 and only the events socket)."""

    def __init__(self, place: ChannelPlace, secret: bytes, rank: int) -> None:
        self.place, self.secret, self.rank = place, secret, rank
        self.ctx = zmq.Context()
        self.curve = _Curve(secret) if place.curve else None
        self.events = _socket(self.ctx, zmq.PUSH, self.curve, server=False)
        self.events.connect(place.endpoint("events"))
        self.ops: zmq.Socket | None = None
        self.seq = 0  # the next TPOps message's number

    def join(self) -> None:
        """Connect to rank 0's ops and say hello (signed: rank 0 admits no rank without the secret)."""
        self.ops = _socket(self.ctx, zmq.DEALER, self.curve, server=False)
        self.ops.identity = _identity(self.rank)
        self.ops.connect(self.place.endpoint("ops"))
        self.ops.send(sign(self.secret, HELLO % self.rank))

    def next_ops(self) -> list[Any]:
        """Block until rank 0 sends the next step's ops; only signed messages, in sequence, count."""
        assert self.ops is not None, "join() first"
        while True:
            msg = TPOps.unpack(self.secret, self.ops.recv())
            if msg is None or msg.seq != self.seq:
                logger.warning("ignored a tensor-parallel message that rank 0 did not send")
                continue
            self.seq += 1
            return msg.ops

    def report(self, kind: str, text: str = "") -> None:
        self.events.send(TPEvent(kind, self.rank, text).pack(self.secret))

    def control_socket(self, ctx: zmq.Context) -> zmq.Socket:
        """A SUB on rank 0's control socket, for the thread that will use it (its own context)."""
        sock = _socket(ctx, zmq.SUB, self.curve, server=False)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.place.endpoint("control"))
        return sock

    def close(self) -> None:
        self.events.close()
        if self.ops is not None:
            self.ops.close(linger=0)
        self.ctx.term()


def _identity(rank: int) -> bytes:
    return b"rank-%d" % rank


def _rank_of(ident: bytes) -> int | None:
    name, _, number = ident.partition(b"-")
    return int(number) if name == b"rank" and number.isdigit() else None
