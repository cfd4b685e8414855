"""NCCL between the GPUs of one machine: peer access, the transport NCCL picks, all-reduce speed.

    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM python3 tools/device/gpu_nccl_probe.py   # 2 processes, one GPU each

Prints one JSON line: can_access_peer, and per message size the all-reduce time (bf16, CUDA events)
and its bus bandwidth (2 (n-1)/n x bytes / time), the sizes of the TP decode (batch 256 x hidden 5120)
and prefill (16384 x 5120) all-reduces of a Qwen3-14B-shaped model among them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"bs1_decode_10KB": 5120, "bs256_decode_2.6MB": 256 * 5120, "prefill_168MB": 16384 * 5120}


def worker(rank: int, world: int, port: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    res = {}
    for name, n in SIZES.items():
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 20 if n > 1e7 else 200
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1000 / iters
        busbw = 2 * (world - 1) / world * n * 2 / (us * 1e-6) / 1e9
        res[name] = {"us": round(us, 1), "busbw_gb_s": round(busbw, 1)}
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = {
        "gpus": world,
        "can_access_peer": torch.cuda.can_device_access_peer(0, 1) if world > 1 else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out["allreduce"] = q.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    print("NCCL_PROBE " + json.dumps(out), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
