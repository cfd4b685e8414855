"""µs per decoder all-reduce + residual add + RMSNorm, three ways, on every GPU of this host (one process each).

    python3 tools/device/reduce_norm_bench.py [--hidden 5120] [--rows 1,8,64,256] [--gpus N]

nccl: NCCL's all-reduce, then flashinfer's fused_add_rmsnorm (minisgl's default);
symm: PyTorch's symmetric-memory one-shot all-reduce (MINISGL_TP_ALLREDUCE=symm_mem), then the same norm;
fused: distributed/reduce_norm.py's one kernel, the projection's output already in its slot
(MINISGL_TP_ALLREDUCE=fused). Each is timed from a CUDA graph of 64 calls (as decode replays them), after a check
that fused and nccl agree. With one GPU only fused runs (world 1: its local cost, no barrier).
"""

from __future__ import annotations

import argparse
import os

import torch


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if world > 1:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world)
    import flashinfer

    from minisgl.distributed import SymmMemAllReduce, set_tp_info, symm_mem_group
    from minisgl.distributed.reduce_norm import SymmReduceNorm, reduce_add_rmsnorm

    set_tp_info(rank, world)
    h, eps = args.hidden, 1e-6
    weight = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
    fused = SymmReduceNorm(dev, symm_mem_group(), rank, world, 8 << 20) if world > 1 else None
    symm = SymmMemAllReduce(dev) if world > 1 else None

    def timed(fn, reps: int = 64) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        if world > 1:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / (5 * reps)

    for m in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)
        part = torch.randn(m, h, device=dev, dtype=torch.bfloat16, generator=gen)
        residual = torch.randn(
            m, h, device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(7)
        )
        row = {}
        if world == 1:
            bufs = torch.tensor([part.data_ptr()], dtype=torch.int64, device=dev)
            flags = torch.zeros(1, dtype=torch.int64, device=dev)
            r = residual.clone()
            row["fused"] = timed(lambda: reduce_add_rmsnorm(bufs, flags, 0, m, r, weight, eps))
            x, r2 = part.clone(), residual.clone()
            row["norm only"] = timed(lambda: flashinfer.norm.fused_add_rmsnorm(x, r2, weight, eps))
        else:
            # agreement: fused against NCCL + flashinfer's norm, once
            ref_x, ref_r = part.clone(), residual.clone()
            dist.all_reduce(ref_x)
            flashinfer.norm.fused_add_rmsnorm(ref_x, ref_r, weight, eps)
            slot = fused.partial_out(m, h, torch.bfloat16)
            slot.copy_(part)
            r = residual.clone()
            out, r = fused(slot, r, weight, eps)
            torch.cuda.synchronize()
            agree = ((out.float() - ref_x.float()).abs().max().item(), torch.equal(r, ref_r))

            x, r_n = part.clone(), residual.clone()

            def nccl() -> None:
                dist.all_reduce(x)
                flashinfer.norm.fused_add_rmsnorm(x, r_n, weight, eps)

            def symm_mem() -> None:
                y = symm(x)
                flashinfer.norm.fused_add_rmsnorm(y, r_n, weight, eps)

            def one() -> None:
                s = fused.partial_out(m, h, torch.bfloat16)
                fused(s, r_n, weight, eps)

            row["nccl"] = timed(nccl)
            row["symm"] = timed(symm_mem)
            row["fused"] = timed(one)
            row["max |fused - nccl|"] = agree[0]
            row["residual equal"] = agree[1]
        if rank == 0:
            print(
                f"rows {m:4d} hidden {h}: "
                + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True,
            )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--rows", default="1,8,64,128,256")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = p.parse_args()
    if args.gpus == 1:
        run(0, 1, args)
    else:
        torch.multiprocessing.spawn(run, args=(args.gpus, args), nprocs=args.gpus)


if __name__ == "__main__":
    main()
