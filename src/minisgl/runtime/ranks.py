"""Tensor parallelism's processes: spawning the ranks, the rendezvous and NCCL/gloo setup, failure watching.

The schedulers the ranks run, and the ops rank 0 sends them each step, are in runtime/tp.py. Ops and failure
notices travel over the control channel (distributed/channel.py): ipc sockets in a private directory on one host,
CURVE-encrypted tcp across hosts. Rank 0 only sends and never waits for the others on the host.

The process group's rendezvous is a FileStore in that private directory on one host (no port at all), and node
0's TCPStore on dist_init_addr across hosts, bound to that address only. Neither carries anything after start-up.
Gloo's and NCCL's own sockets are pinned to the loopback interface on one host.

Failures are loud and bounded. Rank 0 watches its local ranks and the events channel (a failing rank, or a
node's launcher, reports there); on a failure it aborts the communicators (a collective with a dead peer waits
forever on the GPU), tells every rank on the control channel, and raises RankFailedError. Ranks > 0 watch the
control channel from a thread: when rank 0 is gone (its socket disconnects, or its heartbeat stops) or a failure
is announced, they exit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from minisgl.config import EngineConfig
from minisgl.distributed import reset_symm_mem, set_tp_info, setup_symm_mem
from minisgl.distributed.auth import child_env, load_secret
from minisgl.distributed.channel import ChannelPlace, Hub, Spoke, TPEvent, TPOps
from minisgl.errors import MiniSGLError

logger = logging.getLogger("minisgl")

WATCH_INTERVAL_S = 0.25  # how often rank 0 checks its ranks (and sends a heartbeat)
HEARTBEAT_TIMEOUT_S = 30.0  # a rank > 0 that hears nothing from rank 0 this long leaves (a frozen or cut-off host)
FAILURE_GRACE_S = 2.0  # after a collective errors out, how long rank 0 looks for the rank that failed
EXIT_WAIT_S = 10.0  # how long a clean shutdown waits for the other ranks to leave
STUCK_EXIT_S = 15.0  # after a failure, how long rank 0's step in flight may take to return before the process ends
# The same with a symmetric-memory all-reduce (tp_allreduce "symm_mem" / "fused" / "fused_ll" on CUDA): its kernels
# wait for the dead peer forever, so a step in flight never returns; only a step before its first collective could.
SYMM_STUCK_EXIT_S = 0.5


class RankFailedError(MiniSGLError, RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_store(init_addr: str, is_master: bool, timeout: datetime.timedelta) -> Any:
    """The TCPStore at init_addr ("host:port"): rank 0 hosts it, the others connect (retrying until timeout).

    Rank 0's store listens on that address only: left to itself, torch's TCPStore listens on every interface.
    """

    host, _, port = init_addr.rpartition(":")
    host = host.strip("[]")
    if not is_master:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    listener = _listen(host, int(port))
    try:
        store = dist.TCPStore(
            host, int(port), is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.fileno()
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(addr)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def rendezvous_store(config: EngineConfig, place: ChannelPlace, is_master: bool) -> Any:
    """The process group's rendezvous: a FileStore in the private directory on one host, node 0's TCPStore else."""

    if place.directory is not None:
        return dist.FileStore(place.store_path(), config.tp)
    assert config.dist_init_addr, "EngineConfig validation guarantees it"
    return connect_store(config.dist_init_addr, is_master, datetime.timedelta(seconds=config.dist_timeout))


def channel_place(config: EngineConfig) -> ChannelPlace:
    """Rank 0's choice: a fresh private directory on one host, node 0's address across hosts."""
    if config.nnodes > 1:
        assert config.dist_init_addr, "EngineConfig validation guarantees it"
        return ChannelPlace.of_nodes(config.dist_init_addr)
    return ChannelPlace.private()


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    return next((n for n in names if n.startswith("lo")), "lo")


def init_distributed(config: EngineConfig, rank: int, store: Any) -> None:
    """Join the TP process group through `store` and set this rank's device."""

    use_cuda = config.device != "cpu" and torch.cuda.is_available()
    if config.nnodes == 1:  # gloo's and NCCL's own sockets: loopback only, unless the user chose an interface
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    if use_cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        if "OMP_NUM_THREADS" not in os.environ:
            # The host side of a GPU rank is small tensors; every rank's pool of CPU threads waking up for
            # each of them, on shared cores, made the host the bottleneck of a step (as vLLM's workers, 1).
            torch.set_num_threads(1)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        store=store,
        rank=rank,
        world_size=config.tp,
        timeout=datetime.timedelta(seconds=config.dist_timeout),
    )
    set_tp_info(rank, config.tp, moe_parallel=config.moe_parallel)
    if use_cuda and config.nnodes == 1:  # one host: the GPUs reach each other's memory
        setup_symm_mem(torch.device("cuda", torch.cuda.current_device()), config.tp_allreduce, config.tp_fused_mb)


def _bounded(fn: Any, timeout: float, what: str) -> bool:
    """Run fn in a daemon thread, abandoned after timeout seconds (NCCL teardown can block for good)."""

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - already aborted / torn down / a backend without it
            logger.debug("tensor-parallel %s: %s", what, e)

    t = threading.Thread(target=run, name=f"minisgl-tp-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        logger.warning("tensor-parallel %s did not finish in %.0fs; leaving it", what, timeout)
        return False
    return True


def abort_communicators(timeout: float = 10.0) -> None:
    """Abort this rank's NCCL communicators: kernels waiting for a dead peer return. Safe from any thread."""

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return  # gloo fails a collective with a dead peer by itself
    pg = dist.group.WORLD
    abort = getattr(pg, "abort", None) or getattr(pg._get_backend(torch.device("cuda")), "abort", None)
    if abort is None:
        logger.warning("this torch cannot abort an NCCL communicator; a collective may wait until dist_timeout")
        return
    _bounded(abort, timeout, "abort")


def close_groups(clean: bool, timeout: float = 10.0) -> None:
    """Leave the process groups, in bounded time.

    clean: every rank is leaving now and calls this at the same time, so destroying the groups is a quick
    collective teardown. Otherwise (a peer failed or is gone) the groups are aborted, which is local.
    Either is abandoned after `timeout` seconds: with NCCL, a destroy whose peers have already exited,
    or an abort with a peer in a bad state, can block for good (torch waits on it even past its own timeout).
    """

    reset_symm_mem()
    if not dist.is_initialized():
        return
    if clean:
        _bounded(dist.destroy_process_group, timeout, "teardown")
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None) or dist.destroy_process_group
    _bounded(abort, timeout, "abort")


def spawn_worker(config: EngineConfig, rank: int, place: ChannelPlace, secret: bytes) -> subprocess.Popen:
    """Start rank `rank` as `python -m minisgl.runtime.tp` (no re-import of the caller's __main__); the
    secret goes in its environment, never on its command line."""
    payload = json.dumps(dataclasses.asdict(config))
    return subprocess.Popen(
        [sys.executable, "-m", "minisgl.runtime.tp", payload, str(rank), str(place)], env=child_env(secret)
    )


# ---------------------------------------------------------------------------- ranks > 0


class RankZeroWatch:
    """A thread of a rank > 0: exits the process when rank 0 is gone or announces a failure.

    The main thread may be stuck in a collective whose peer died (on the GPU it never returns), so the exit is
    os._exit from here. Rank 0 is gone when its control socket disconnects after having connected, or when its
    heartbeat stops for HEARTBEAT_TIMEOUT_S (a frozen host, a cut cable).
    """

    def __init__(self, spoke: Spoke, rank: int) -> None:
        self.spoke, self.rank = spoke, rank
        self.leaving = threading.Event()  # set on a clean exit: rank 0 may close its sockets under us then
        threading.Thread(target=self._run, name="minisgl-tp-watch", daemon=True).start()

    def _run(self) -> None:

        ctx = zmq.Context()
        sub = self.spoke.control_socket(ctx)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        heard, connected = time.monotonic(), False
        while not self.leaving.is_set():
            ready = dict(poller.poll(WATCH_INTERVAL_S * 1000))
            reason = None
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                connected = connected or event == zmq.EVENT_CONNECTED
                if event == zmq.EVENT_DISCONNECTED and connected:
                    reason = "lost rank 0 (its control channel closed)"
            if sub in ready:
                notice = TPEvent.unpack(self.spoke.secret, sub.recv())
                heard = time.monotonic() if notice is not None else heard
                if notice is not None and notice.kind == "failed":
                    reason = notice.text
            if reason is None and time.monotonic() - heard > HEARTBEAT_TIMEOUT_S:
                reason = f"lost rank 0 (no word from it in {HEARTBEAT_TIMEOUT_S:.0f}s)"
            if reason is not None and not self.leaving.is_set():
                leave(1, f"tensor-parallel rank {self.rank} stops: {reason}")


def leave(code: int, message: str) -> None:
    logger.error("%s", message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------- rank 0


class RankGroup:
    """Rank 0's side of the group: binds the channel, spawns this node's other ranks, watches them.

    On a failure (a local rank exited, or a rank reported one on the events channel) it aborts the communicators,
    announces it on the control channel, and every later step raises RankFailedError.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.secret = load_secret(config)
        self.place = channel_place(config)
        try:
            self.hub = Hub(self.place, self.secret, config.tp)
            self.store = rendezvous_store(config, self.place, is_master=True)
        except BaseException:
            self.place.remove()
            raise
        self.seq = 0  # the next TPOps message's number
        local = range(1, config.tp // config.nnodes)
        self.workers = [spawn_worker(config, rank, self.place, self.secret) for rank in local]
        self._failure: str | None = None
        self._failed_at = 0.0  # monotonic time of the failure
        self._exited: set[int] = set()  # ranks that confirmed a clean exit (the monitor thread adds them)
        self.step_started: float | None = None  # monotonic start of rank 0's step in flight (TPScheduler.step)
        self._fail_lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="minisgl-tp-monitor", daemon=True)
        self._monitor.start()

    def _start_failed(self, error: Exception) -> Exception:
        """Rank 0 could not start: stop the ranks; returns the error to raise."""
        error = self._as_rank_failure(error)
        self._stop.set()
        self._monitor.join(timeout=5)
        close_groups(clean=False, timeout=5)
        for w in self.workers:
            w.kill()
            w.wait()
        self._close_channel()
        return error

    def _monitor_loop(self) -> None:
        """The monitor thread: reads the events channel, polls the local ranks, sends the heartbeat (or the
        failure) on the control channel, and ends a process whose step is stuck after a failure."""
        while not self._stop.is_set():
            for event in self.hub.events_ready(int(WATCH_INTERVAL_S * 1000)):
                if event.kind == "exited":
                    self._exited.add(event.rank)
                elif event.kind == "failed":
                    self._fail(event.text)
            dead = self._dead_workers()
            if dead is not None:
                self._fail(dead)
            if self._stop.is_set():
                return
            failure = self._failure
            self.hub.publish(TPEvent("failed", 0, failure) if failure is not None else TPEvent("heartbeat", 0))
            if failure is not None:
                self._end_if_stuck(self._failed_at + self._stuck_wait())

    def _stuck_wait(self) -> float:
        c = self.config
        symm = c.tp_allreduce != "nccl" and c.device != "cpu" and torch.cuda.is_available() and c.nnodes == 1
        return min(STUCK_EXIT_S, SYMM_STUCK_EXIT_S) if symm else STUCK_EXIT_S

    def _end_if_stuck(self, deadline: float) -> None:
        """A step in flight when a rank failed must come back: NCCL's aborted kernels return, and the step raises
        RankFailedError. One that does not is stuck in a kernel waiting for the dead peer forever (a
        symmetric-memory all-reduce cannot be aborted), and so would every later CUDA call of this process:
        the process ends, loudly, so that its parent (the daemon) reports the failure instead of hanging."""
        if self.step_started is not None and time.monotonic() > deadline:
            self.place.remove()  # os._exit skips every cleanup
            leave(
                1,
                f"{self._failure}; a step on this rank has not come back within {self._stuck_wait():g}s "
                "(stuck in a kernel waiting for the dead rank): this process exits",
            )

    def _dead_workers(self) -> str | None:
        dead = [
            (rank, w.returncode)
            for rank, w in enumerate(self.workers, 1)
            if w.poll() is not None and rank not in self._exited  # a rank that confirmed its exit may leave
        ]
        if not dead:
            return None
        return (
            f"tensor-parallel rank(s) {[r for r, _ in dead]} exited (codes {[c for _, c in dead]}): "
            "see the ranks' log lines above"
        )

    def _fail(self, reason: str) -> None:
        """Record the first failure and abort the communicators (in the background: an abort can block for as
        long as a kernel waits on the dead peer). The monitor thread announces it to every rank."""
        with self._fail_lock:
            if self._failure is not None:
                return
            self._failure, self._failed_at = reason, time.monotonic()
        logger.error("%s; the engine stops", reason)
        threading.Thread(target=abort_communicators, name="minisgl-tp-abort", daemon=True).start()

    def _as_rank_failure(self, error: Exception) -> Exception:
        """The RankFailedError behind a failed step, if a rank failed (waiting a little to find it); else error."""
        if self._failure is None and isinstance(error, RuntimeError):
            deadline = time.monotonic() + FAILURE_GRACE_S
            while self._failure is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the monitor thread finds it
        if self._failure is None:
            return error
        return RankFailedError(f"{self._failure}; the engine stops")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RankFailedError(f"{self._failure}; the engine stops")

    def check_ranks(self) -> None:
        """Before the process group forms: every other rank said hello with the secret (no collective runs with a
        process that does not hold it); RankFailedError when one does not within dist_timeout."""
        deadline = time.monotonic() + self.config.dist_timeout
        waiting = set(range(1, self.config.tp))
        while waiting:
            self._raise_if_failed()  # a local rank that died before it answered
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"tensor-parallel rank(s) {sorted(waiting)} did not join within dist_timeout "
                    f"({self.config.dist_timeout:.0f}s): every node needs the same secret (MINISGL_TP_SECRET or "
                    "--tp-secret-file) and must reach node 0's dist_init_addr port P and ports P+1..P+3"
                )
            waiting.discard(self.hub.hello_from(100))

    def _send(self, ops: list[Any]) -> None:
        self.hub.send_ops(TPOps(self.seq, ops).pack(self.secret))
        self.seq += 1

    def _wait_exited(self) -> bool:
        deadline = time.monotonic() + EXIT_WAIT_S
        while len(self._exited) < self.config.tp - 1:
            if self._failure is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _stop_ranks(self, on_cuda: bool) -> None:
        """Stop every rank: "exit" to each, wait until they confirm (bounded), then abort the groups."""
        clean = False
        if self._failure is None:
            try:
                self._send([("exit",)])
                if on_cuda:
                    torch.cuda.synchronize()  # the last steps' collectives, which the other ranks finish too
                clean = self._wait_exited()
            except Exception as e:  # noqa: BLE001 - a rank died during shutdown: the monitor reports it
                logger.debug("tensor-parallel shutdown: %s", e)
        if not clean:
            self._fail(self._failure or "a tensor-parallel rank did not confirm the shutdown")
            time.sleep(WATCH_INTERVAL_S * 2)  # the monitor announces it: ranks on other nodes leave
        self._stop.set()
        self._monitor.join(timeout=5)
        close_groups(clean)
        for w in self.workers:
            try:
                w.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self._close_channel()
        set_tp_info(0, 1)

    def _close_channel(self) -> None:
        self.store = None
        if not self._monitor.is_alive():
            self.hub.close()  # ranks still connected (other nodes) see it disconnect and leave
        self.place.remove()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        for w in getattr(self, "workers", []):
            if w.poll() is None:
                w.kill()
        place = getattr(self, "place", None)
        if place is not None:
            place.remove()


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (multi-node TP): run this node's ranks until they exit; returns an exit code.

    A rank that exits with an error is reported to rank 0 on the events channel, so that the engine stops at
    once instead of waiting on that rank's collectives.
    """
    local = config.tp // config.nnodes
    first = config.node_rank * local
    secret = load_secret(config)
    place = channel_place(config)
    workers = {rank: spawn_worker(config, rank, place, secret) for rank in range(first, first + local)}
    logger.info(
        "node %d: ranks %d..%d started, following node 0 at %s",
        config.node_rank,
        first,
        first + local - 1,
        config.dist_init_addr,
    )
    codes: dict[int, int] = {}
    while len(codes) < len(workers):
        for rank, w in workers.items():
            if rank not in codes and w.poll() is not None:
                codes[rank] = w.returncode
                if w.returncode != 0:
                    _report_failure(
                        place,
                        secret,
                        f"tensor-parallel rank {rank} on node {config.node_rank} exited (code {w.returncode})",
                    )
        time.sleep(WATCH_INTERVAL_S / 5)
    return max(codes.values(), key=abs)


def _report_failure(place: ChannelPlace, secret: bytes, reason: str) -> None:
    spoke = Spoke(place, secret, -1)
    try:
        spoke.report("failed", reason)
    finally:
        spoke.close()  # lingers until the report is out, or rank 0 is gone
