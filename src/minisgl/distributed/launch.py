"""Tensor parallelism's processes: spawning the ranks, the TCPStore and NCCL/gloo setup, failure watching.

The schedulers the ranks run, and the ops rank 0 sends them each step, are in scheduler/tp.py. The ops
reach ranks > 0 through the rendezvous TCPStore that rank 0 hosts: one queue per rank, one small
message per step. Rank 0 only appends to the queues and never waits for the others on the host.

Failures are loud and bounded. Rank 0 watches its local ranks and a "failed" key (set by a failing rank
or by a node's launcher); on a failure it aborts the communicators (a collective with a dead peer waits
forever on the GPU) and raises RankFailedError. Ranks > 0 watch the store from a thread: when rank 0 is
gone (its store closes) or the key is set, they exit.
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

from minisgl.config import EngineConfig
from minisgl.distributed import reset_symm_mem, set_tp_info, setup_symm_mem
from minisgl.distributed.auth import PROOF_KEY, check_proofs, child_env, load_secret, post_challenge, sign, verify
from minisgl.errors import MiniSGLError

logger = logging.getLogger("minisgl")

OPS_KEY = "minisgl/ops/{rank}"  # rank 0 -> rank: one signed TPOps message (msgpack) per step
FAILED_KEY = "minisgl/failed"  # why the engine stops; set once by whoever sees a rank fail
EXITED_KEY = "minisgl/exited"  # ranks that left cleanly after rank 0's "exit"
WATCH_INTERVAL_S = 0.5  # how often rank 0 checks its ranks and ranks > 0 check on rank 0
FAILURE_GRACE_S = 2.0  # after a collective errors out, how long rank 0 looks for the rank that failed
EXIT_WAIT_S = 10.0  # how long a clean shutdown waits for the other ranks to leave
STUCK_EXIT_S = 15.0  # after a failure, how long rank 0's step in flight may take to return before the process ends
# The same with a symmetric-memory all-reduce (tp_allreduce "symm_mem" / "fused" on CUDA): its kernels wait for the
# dead peer forever, so a step in flight never returns; only a step still before its first collective could.
SYMM_STUCK_EXIT_S = 3.0


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
    import torch.distributed as dist

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


def set_failed(store: Any, secret: bytes, reason: str) -> None:
    """Flag the engine as failed (every rank leaves); signed, so that nobody else can stop it."""
    store.set(FAILED_KEY, sign(secret, reason.encode()))


def read_failed(store: Any, secret: bytes) -> str | None:
    """Why the engine stops, if a rank flagged a failure; a value not signed with the secret is ignored."""
    if not store.check([FAILED_KEY]):
        return None
    reason = verify(secret, store.get(FAILED_KEY))
    if reason is None:
        logger.warning("ignored a failure flag in the tensor-parallel store that is not signed with the secret")
        return None
    return reason.decode(errors="replace")


def init_distributed(config: EngineConfig, rank: int, store: Any) -> None:
    """Join the TP process group through `store` and set this rank's device."""
    import torch.distributed as dist

    use_cuda = config.device != "cpu" and torch.cuda.is_available()
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
    import torch.distributed as dist

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
    import torch.distributed as dist

    reset_symm_mem()
    if not dist.is_initialized():
        return
    if clean:
        _bounded(dist.destroy_process_group, timeout, "teardown")
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None) or dist.destroy_process_group
    _bounded(abort, timeout, "abort")


def spawn_worker(config: EngineConfig, rank: int, init_addr: str, secret: bytes) -> subprocess.Popen:
    """Start rank `rank` as `python -m minisgl.scheduler.tp` (no re-import of the caller's __main__); the
    secret goes in its environment, never on its command line."""
    payload = json.dumps(dataclasses.asdict(config))
    return subprocess.Popen(
        [sys.executable, "-m", "minisgl.scheduler.tp", payload, str(rank), init_addr], env=child_env(secret)
    )


# ---------------------------------------------------------------------------- ranks > 0


class RankZeroWatch:
    """A thread of a rank > 0: exits the process when rank 0 is gone or a failure is flagged.

    The main thread may be stuck in a collective whose peer died (on the GPU it never returns), so
    the exit is os._exit from here. Its own store connection: the main thread's blocks in a queue pop.
    """

    def __init__(self, init_addr: str, timeout: datetime.timedelta, rank: int, secret: bytes) -> None:
        self.rank = rank
        self.secret = secret
        self.leaving = threading.Event()  # set on a clean exit: the store may close under us then
        self.client = connect_store(init_addr, False, timeout)
        threading.Thread(target=self._run, name="minisgl-tp-watch", daemon=True).start()

    def _run(self) -> None:
        while not self.leaving.wait(WATCH_INTERVAL_S):
            try:
                reason = read_failed(self.client, self.secret)
            except Exception as e:  # noqa: BLE001 - rank 0 hosts the store: it is gone or frozen
                reason = f"lost rank 0 ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            if reason is not None and not self.leaving.is_set():
                leave(1, f"tensor-parallel rank {self.rank} stops: {reason}")


def leave(code: int, message: str) -> None:
    logger.error("%s", message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------- rank 0


class RankGroup:
    """Rank 0's side of the group: hosts the store, spawns this node's other ranks, watches them.

    On a failure (a local rank exited, or the store's failed key is set) it aborts the communicators
    and every later step raises RankFailedError.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        init_addr = config.dist_init_addr or f"127.0.0.1:{free_port()}"
        self.secret = load_secret(config)
        self.store = connect_store(init_addr, True, datetime.timedelta(seconds=config.dist_timeout))
        post_challenge(self.store)
        self.seq = 0  # the next TPOps message's number
        local = range(1, config.tp // config.nnodes)
        self.workers = [spawn_worker(config, rank, init_addr, self.secret) for rank in local]
        self._failure: str | None = None
        self.step_started: float | None = None  # monotonic start of rank 0's step in flight (TPScheduler.step)
        self._fail_lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="minisgl-tp-monitor", daemon=True)
        self._monitor.start()

    def _start_failed(self, error: Exception) -> Exception:
        """Rank 0 could not start: stop the ranks; returns the error to raise."""
        error = self._as_rank_failure(error)
        self._stop.set()
        close_groups(clean=False, timeout=5)
        for w in self.workers:
            w.kill()
            w.wait()
        return error

    def _monitor_loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            reason = self._find_failure()
            if reason is not None:
                self._fail(reason)
                self._watch_stuck_step()
                return

    def _watch_stuck_step(self) -> None:
        """A step in flight when a rank failed must come back: NCCL's aborted kernels return, and the step raises
        RankFailedError. One that does not is stuck in a kernel waiting for the dead peer forever (a
        symmetric-memory all-reduce cannot be aborted), and so would every later CUDA call of this process:
        the process ends, loudly, so that its parent (the daemon) reports the failure instead of hanging."""
        c = self.config
        symm = c.tp_allreduce != "nccl" and c.device != "cpu" and torch.cuda.is_available() and c.nnodes == 1
        wait = min(STUCK_EXIT_S, SYMM_STUCK_EXIT_S) if symm else STUCK_EXIT_S
        deadline = time.monotonic() + wait
        while not self._stop.wait(WATCH_INTERVAL_S):
            if self.step_started is None:
                return  # no step in flight, or it came back: the caller sees RankFailedError
            if time.monotonic() > deadline:
                leave(
                    1,
                    f"{self._failure}; a step on this rank has not come back within {wait:.0f}s "
                    "(stuck in a kernel waiting for the dead rank): this process exits",
                )

    def _find_failure(self) -> str | None:
        dead = [(rank, w.returncode) for rank, w in enumerate(self.workers, 1) if w.poll() is not None]
        if dead:
            return (
                f"tensor-parallel rank(s) {[r for r, _ in dead]} exited (codes {[c for _, c in dead]}): "
                "see the ranks' log lines above"
            )
        try:
            return read_failed(self.store, self.secret)
        except Exception:  # noqa: BLE001 - this process hosts the store: only a shutdown gets here
            return None

    def _fail(self, reason: str) -> None:
        with self._fail_lock:
            if self._failure is not None:
                return
            self._failure = reason
        logger.error("%s; the engine stops", reason)
        try:
            set_failed(self.store, self.secret, reason)  # the other ranks (other nodes too) leave
        except Exception:  # noqa: BLE001 - the store is closing
            pass
        abort_communicators()

    def _as_rank_failure(self, error: Exception) -> Exception:
        """The RankFailedError behind a failed step, if a rank failed (waiting a little to find it); else error."""
        if self._failure is None and isinstance(error, RuntimeError):
            deadline = time.monotonic() + FAILURE_GRACE_S
            while self._failure is None and time.monotonic() < deadline:
                reason = self._find_failure()
                if reason is not None:
                    self._fail(reason)
                    break
                time.sleep(0.05)
        if self._failure is None:
            return error
        return RankFailedError(f"{self._failure}; the engine stops")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RankFailedError(f"{self._failure}; the engine stops")

    def check_ranks(self) -> None:
        """Before the process group forms: every other rank proved the secret (AuthError otherwise)."""
        deadline = time.monotonic() + self.config.dist_timeout
        proofs = [PROOF_KEY.format(rank=rank) for rank in range(1, self.config.tp)]
        while not self.store.check(proofs):
            self._raise_if_failed()  # a local rank that died before it answered
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"not every tensor-parallel rank joined within dist_timeout ({self.config.dist_timeout:.0f}s)"
                )
            time.sleep(0.02)
        check_proofs(self.store, self.secret, self.config.tp)

    def _send(self, ops: list[Any]) -> None:
        from minisgl.runtime.protocol import TPOps, encode

        payload = sign(self.secret, encode(TPOps(self.seq, [list(op) for op in ops])))
        self.seq += 1
        for rank in range(1, self.config.tp):
            self.store.queue_push(OPS_KEY.format(rank=rank), payload)

    def _wait_exited(self) -> bool:
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.store.add(EXITED_KEY, 0) < self.config.tp - 1:
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
        self._stop.set()
        self._monitor.join(timeout=5)
        close_groups(clean)
        for w in self.workers:
            try:
                w.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self.store = None  # closes the store: ranks still waiting on it (other nodes) leave
        set_tp_info(0, 1)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        for w in getattr(self, "workers", []):
            if w.poll() is None:
                w.kill()


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (multi-node TP): run this node's ranks until they exit; returns an exit code.

    A rank that exits with an error is reported to rank 0 through the store's failed key, so that the
    engine stops at once instead of waiting on that rank's collectives.
    """
    local = config.tp // config.nnodes
    first = config.node_rank * local
    assert config.dist_init_addr, "EngineConfig validation guarantees it"
    secret = load_secret(config)
    workers = {rank: spawn_worker(config, rank, config.dist_init_addr, secret) for rank in range(first, first + local)}
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
                        config,
                        secret,
                        f"tensor-parallel rank {rank} on node {config.node_rank} exited (code {w.returncode})",
                    )
        time.sleep(WATCH_INTERVAL_S / 5)
    return max(codes.values(), key=abs)


def _report_failure(config: EngineConfig, secret: bytes, reason: str) -> None:
    assert config.dist_init_addr
    try:
        store = connect_store(config.dist_init_addr, False, datetime.timedelta(seconds=5))
        if not store.check([FAILED_KEY]):
            set_failed(store, secret, reason)
    except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
        pass
