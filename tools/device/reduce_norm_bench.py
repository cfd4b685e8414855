"""The fused all-reduce + residual add + RMSNorm on the GPUs of one host: µs per call, three ways.

    python3 tools/device/reduce_norm_bench.py [--hidden 5120,2048] [--rows 1,16,64,256,1024]

- nccl: NCCL's all-reduce, then flashinfer's fused_add_rmsnorm (what `tp_allreduce="nccl"` runs);
- fused: distributed/reduce_norm.py as the engine runs it;
- fused_ll: its variant without a barrier (`tp_allreduce="fused_ll"`);
- fused+programs=N, fused_ll+programs=N: with N programs (the grid) instead of one a row.

One process per GPU. Each way is a CUDA graph of 20 calls; the figure is the median over 5 replays of a replay's
time / 20 (CUDA events), the ranks lined up by a barrier before each replay, and the spread (min-max) beside it.
The fused kernel's outputs are checked against the NCCL way's on the same inputs: the new residual bit for bit,
the norm's largest difference (flashinfer rounds its products in another order). Prints one JSON line per rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS, REPLAYS, EPS = 20, 5, 1e-6


def timed(fn, stream: torch.cuda.Stream) -> tuple[float, float, float]:
    """(median, min, max) µs per call of fn (one call), captured CALLS times in one graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPLAYS + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    times = times[1:]
    return round(statistics.median(times), 2), round(min(times), 2), round(max(times), 2)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import flashinfer

    from minisgl.distributed.reduce_norm import SymmReduceNorm

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=device,
        timeout=datetime.timedelta(seconds=120),
    )
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group)
    max_rows, hidden_max = max(args.rows), max(args.hidden)
    ways = {
        "fused": SymmReduceNorm(device, group, rank, world, max_rows * hidden_max * 2),
        "fused_ll": SymmReduceNorm(device, group, rank, world, max_rows * hidden_max * 2, low_latency=True),
    }
    stream = torch.cuda.Stream()
    results = []
    for hidden in args.hidden:
        weight = (torch.rand(hidden, device=device) + 0.5).to(torch.bfloat16)
        for rows in args.rows:
            g = torch.Generator(device=device).manual_seed(1 + rank)
            part = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
            residual = torch.randn(rows, hidden, device=device, generator=torch.Generator(device=device).manual_seed(0))
            residual = residual.to(torch.bfloat16)
            # Outputs first: both ways on the same inputs.
            x, res_n = part.clone(), residual.clone()
            dist.all_reduce(x)
            flashinfer.norm.fused_add_rmsnorm(x, res_n, weight, EPS)
            row = {"hidden": hidden, "rows": rows, "MB": round(rows * hidden * 2 / 2**20, 2)}
            for name, fused in ways.items():
                slot = fused.partial_out(rows, hidden, torch.bfloat16)
                slot.copy_(part)
                res_f = residual.clone()
                out_f, _ = fused(slot, res_f, weight, EPS)
                row[name + ": residual identical"] = bool(torch.equal(res_f, res_n))
                row[name + ": norm max diff"] = float((out_f.float() - x.float()).abs().max())
            buf, res = part.clone(), residual.clone()

            def nccl():
                dist.all_reduce(buf)
                flashinfer.norm.fused_add_rmsnorm(buf, res, weight, EPS)

            row["nccl"] = timed(nccl, stream)
            for name, fused in ways.items():
                for programs in [None, *args.programs]:

                    def fused_call(fused=fused, programs=programs):
                        fused(fused.partial_out(rows, hidden, torch.bfloat16), res, weight, EPS, programs)

                    row[name + (f"+programs={programs}" if programs else "")] = timed(fused_call, stream)
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", default="5120,2048")
    p.add_argument("--rows", default="1,16,64,256,1024")
    p.add_argument("--programs", default="132", help="more grids for the fused kernel, comma-separated")
    args = p.parse_args()
    args.hidden = [int(h) for h in args.hidden.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    args.programs = [int(n) for n in args.programs.split(",") if n]
    world = torch.cuda.device_count()
    assert world >= 2, "needs two GPUs"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, q)) for r in range(world)]
    for proc in procs:
        proc.start()
    print("REDUCE_NORM " + json.dumps(q.get(timeout=300)), flush=True)
    for proc in procs:
        proc.join(timeout=30)


if __name__ == "__main__":
    main()
