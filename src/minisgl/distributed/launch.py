"""Tensor parallelism: one scheduler per rank; rank 0 takes requests and broadcasts them.

Every rank runs the same Scheduler on the same inputs, so every rank builds the same batches;
the model's layers all-reduce / all-gather through torch.distributed (NCCL on CUDA, gloo on
CPU). Requests cross ranks as a pickled op list on a gloo group, once per step.
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
from minisgl.core import SamplingParams, TokenOutput
from minisgl.distributed import set_tp_info
from minisgl.errors import MiniSGLError

logger = logging.getLogger("minisgl")

_OBJECT_GROUP: Any = None


class RankFailedError(MiniSGLError, RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(config: EngineConfig, rank: int, init_addr: str) -> None:
    """Join the TP process group (tcp:// rendezvous at init_addr) and set this rank's device."""
    import torch.distributed as dist

    global _OBJECT_GROUP
    timeout = datetime.timedelta(seconds=config.dist_timeout)
    use_cuda = config.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local_rank = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo", init_method=f"tcp://{init_addr}",
        rank=rank, world_size=config.tp, timeout=timeout,
    )
    _OBJECT_GROUP = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else dist.group.WORLD
    set_tp_info(rank, config.tp)


def broadcast_ops(ops: list[Any] | None, group: Any = None) -> list[Any]:
    """Rank 0 sends its op list to every rank (over `group`, default this process's); the others receive it."""
    import torch.distributed as dist

    box = [ops]
    dist.broadcast_object_list(box, src=0, group=group if group is not None else _OBJECT_GROUP)
    return box[0]


def destroy_group(timeout: float) -> bool:
    """Tear the process groups down, bounded: NCCL's teardown waits for the peer ranks to do the same.

    Every rank calls this at about the same time (after rank 0's "exit"); a rank that is gone must
    not hang the others, so the teardown runs in a thread that is abandoned after `timeout` seconds.
    """
    import torch.distributed as dist

    global _OBJECT_GROUP
    if not dist.is_initialized():
        return True
    t = threading.Thread(target=dist.destroy_process_group, name="minisgl-tp-teardown", daemon=True)
    t.start()
    t.join(timeout)
    _OBJECT_GROUP = None
    if t.is_alive():
        logger.warning("tensor-parallel teardown did not finish in %.0fs; leaving it", timeout)
        return False
    return True


def _apply(sched: Any, ops: list[Any]) -> None:
    for op in ops:
        if op[0] == "add":
            sched.add_request(op[1], op[2], SamplingParams.from_dict(op[3]))
        elif op[0] == "abort":
            sched.abort(op[1])


def spawn_worker(config: EngineConfig, rank: int, init_addr: str) -> subprocess.Popen:
    """Start rank `rank` as `python -m minisgl.distributed.launch` (no re-import of the caller's __main__)."""
    payload = json.dumps(dataclasses.asdict(config))
    return subprocess.Popen([sys.executable, "-m", "minisgl.distributed.launch", payload, str(rank), init_addr])


def worker_main(config: EngineConfig, rank: int, init_addr: str) -> int:
    """Ranks > 0: mirror rank 0's scheduler step by step until told to exit; returns an exit code."""
    from minisgl.scheduler.scheduler import Scheduler

    logging.basicConfig(level=logging.WARNING, format=f"[minisgl tp{rank}] %(levelname)s %(message)s")
    init_distributed(config, rank, init_addr)
    sched = Scheduler(config)
    code = 0
    try:
        while True:
            ops = broadcast_ops(None)
            if ops and ops[0][0] == "exit":
                break
            if ops and ops[0][0] == "ping":  # rank 0 is idle but alive
                continue
            _apply(sched, ops)
            sched.step()
    except Exception as e:
        logger.error("rank %d stops: %s", rank, e)
        code = 1
    destroy_group(30 if code == 0 else 5)
    return code


class TPScheduler:
    """Rank 0's view of a tensor-parallel engine: the Scheduler API, mirrored to every rank."""

    def __init__(self, config: EngineConfig) -> None:
        from minisgl.scheduler.scheduler import Scheduler

        init_addr = config.dist_init_addr or f"127.0.0.1:{free_port()}"
        local = config.tp // config.nnodes
        self.workers = [spawn_worker(config, rank, init_addr) for rank in range(1, local)]
        init_distributed(config, 0, init_addr)
        self.sched = Scheduler(config)
        self.tokenizer = self.sched.tokenizer
        self.model_config = self.sched.model_config
        self.device = self.sched.device
        self.prefix_cache = self.sched.prefix_cache
        self.engine = self.sched.engine
        # Bound now: a later engine in this process re-initialises the module's group.
        self._group = _OBJECT_GROUP
        self._ops: list[Any] = []
        # The other ranks wait in a gloo broadcast that times out after dist_timeout: while rank 0 is
        # idle (a daemon with no requests) a thread pings them so that they do not give up.
        self._lock = threading.Lock()
        self._last_broadcast = time.monotonic()
        self._stop = threading.Event()
        self._ping_error: BaseException | None = None
        self._ping_interval = max(0.5, min(30.0, config.dist_timeout / 4))
        self._pinger = threading.Thread(target=self._ping_loop, name="minisgl-tp-ping", daemon=True)
        self._pinger.start()

    def _ping_loop(self) -> None:
        while not self._stop.wait(self._ping_interval / 2):
            with self._lock:
                if self._stop.is_set() or time.monotonic() - self._last_broadcast < self._ping_interval:
                    continue
                try:
                    broadcast_ops([("ping",)], self._group)
                except Exception as e:  # a dead peer (RuntimeError) or groups already torn down
                    self._ping_error = e
                    return
                self._last_broadcast = time.monotonic()

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or bool(self._ops)

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        self.sched.validate(input_ids, params)

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        self.sched.validate(input_ids, params)
        self._ops.append(("add", rid, list(input_ids), params.to_dict()))

    def abort(self, rid: str) -> None:
        self._ops.append(("abort", rid))

    def _check_workers(self) -> None:
        dead = [(rank, w.returncode) for rank, w in enumerate(self.workers, 1) if w.poll() is not None]
        if dead:
            raise RankFailedError(
                f"tensor-parallel rank(s) {[r for r, _ in dead]} exited (codes {[c for _, c in dead]}): "
                "the engine stops; see the ranks' log lines above"
            )

    def step(self) -> list[TokenOutput]:
        self._check_workers()
        if self._ping_error is not None:
            raise RankFailedError(f"a tensor-parallel rank stopped answering: {self._ping_error}")
        ops, self._ops = self._ops, []
        with self._lock:
            try:
                broadcast_ops(ops, self._group)
            except RuntimeError as e:
                raise RankFailedError(f"a tensor-parallel rank stopped answering: {e}") from e
            self._last_broadcast = time.monotonic()
        _apply(self.sched, ops)
        return self.sched.step()

    def stats(self) -> dict[str, int]:
        return self.sched.stats()

    def check_integrity(self) -> None:
        self.sched.check_integrity()

    def reset_prefix_cache(self) -> None:
        self.sched.reset_prefix_cache()

    def shutdown(self) -> None:
        self._stop.set()
        self.sched.shutdown()
        healthy = self._ping_error is None and all(w.poll() is None for w in self.workers)
        with self._lock:
            if healthy:
                try:
                    broadcast_ops([("exit",)], self._group)
                except RuntimeError:
                    healthy = False
            # Every rank tears NCCL down now, together: its teardown waits for the peers.
            destroy_group(30 if healthy else 5)
        self._pinger.join(timeout=5)
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        set_tp_info(0, 1)

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        for w in getattr(self, "workers", []):
            if w.poll() is None:
                w.kill()


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (multi-node TP): run this node's ranks until they exit; returns an exit code."""
    local = config.tp // config.nnodes
    first = config.node_rank * local
    assert config.dist_init_addr, "EngineConfig validation guarantees it"
    workers = [spawn_worker(config, rank, config.dist_init_addr) for rank in range(first, first + local)]
    logger.info("node %d: ranks %d..%d started, following node 0 at %s", config.node_rank, first, first + local - 1,
                config.dist_init_addr)
    codes = [w.wait() for w in workers]
    return max(codes, key=abs)


def make_scheduler(config: EngineConfig) -> Any:
    """The Scheduler for tp == 1, else the TP driver with the same API."""
    if config.tp > 1:
        return TPScheduler(config)
    from minisgl.scheduler.scheduler import Scheduler

    return Scheduler(config)


def _worker_entry(argv: list[str]) -> None:
    fields = json.loads(argv[0])
    code = worker_main(EngineConfig(**fields), int(argv[1]), argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not through interpreter teardown: an abandoned NCCL teardown thread must not hang the exit


if __name__ == "__main__":
    _worker_entry(sys.argv[1:])
