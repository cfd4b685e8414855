"""The split-K Triton GEMM (tools/device/splitk_gemm.py, an experiment) against cuBLAS on the decode GEMMs of the Qwen3-0.6B shape,
µs per call replayed from a CUDA graph (as decode runs them), with the best launch configs of a small sweep.

    python3 tools/device/splitk_bench.py [--shapes 2048x1024,3072x1024] [--rows 1,8,64,256] [--top 3]

One line per (shape, rows): cuBLAS µs, the best config's µs, its share of the weight-read floor (bytes / 3.0 TB/s),
its max error against float32, then the runners-up. The same weight every call: warm in L2, as for cuBLAS.
"""

import argparse
import itertools

import torch

from attn_bench import graph_us
from splitk_gemm import Config, Workspace, splitk_mm

DEV = "cuda"
BANDWIDTH = 3.0e12


def configs(rows: int, n: int, k: int) -> list[Config]:
    bm_min = 16
    p2 = max(bm_min, 1 << (rows - 1).bit_length())
    bms = sorted({min(p2, 128)} | ({64} if rows >= 128 else set()))
    out = []
    for bm, bn, bk, splits, stages in itertools.product(bms, (32, 64, 128), (64, 128, 256), (1, 2, 3, 4, 6, 8, 12, 16), (3, 4)):
        cfg = Config(bm, bn, bk, splits, 4, stages)
        tiles = (n // bn) * -(-rows // bm)
        if not cfg.fits(n, k) or tiles > Workspace.TILES or tiles * splits * bm * bn > Workspace.FLOATS:
            continue
        if bm * bk * 2 * stages + bn * bk * 2 * stages > 200_000:  # shared memory
            continue
        out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x1024,3072x1024,1024x4096,1024x6144")
    ap.add_argument("--rows", default="1,8,16,32,64,128,192,256")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            y = torch.empty(rows, n, device=DEV, dtype=torch.bfloat16)
            cublas = graph_us(lambda: torch.mm(x, w.t(), out=y), calls=20, reps=10)
            floor = (k * n + rows * (k + n)) * 2 / BANDWIDTH * 1e6
            results = []
            for cfg in configs(rows, n, k):
                try:
                    us = graph_us(lambda: splitk_mm(x, w, cfg, out=y), calls=20, reps=10)
                except Exception as e:  # a config Triton cannot build (resources): skipped, said
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                err = (splitk_mm(x, w, cfg).float() - ref).abs().max().item()
                results.append((us, cfg, err))
            results.sort(key=lambda r: r[0])
            us, cfg, err = results[0]
            c = lambda cf: f"{cf.block_m}/{cf.block_n}/{cf.block_k}/s{cf.splits}/st{cf.stages}"  # noqa: E731
            rest = " ".join(f"{c(cf)}={u:.2f}" for u, cf, _ in results[1 : args.top])
            print(
                f"{k}x{n} rows={rows}: cublas {cublas:.2f}us ({floor / cublas:.0%}) | splitk {us:.2f}us ({floor / us:.0%}) "
                f"{c(cfg)} err={err:.3g} (ref max {ref.abs().max().item():.3g}) | {rest}",
                flush=True,
            )


if __name__ == "__main__":
    main()
