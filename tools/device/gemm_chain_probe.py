"""Decode's non-attention chain of 28 Qwen3-0.6B layers (norm, qkv, o, norm, gate_up, silu, down; each layer its own
weights, so they come from HBM as in decode) from one CUDA graph: cuBLAS GEMMs against the split-K Triton GEMM
(splitk_gemm.py) without / with programmatic dependent launch / with PDL and an L2 prefetch of the weights.

    python3 tools/device/gemm_chain_probe.py [rows,rows,...]   # µs per chain; d = max difference / max of cuBLAS's
"""

import sys

import torch
import flashinfer

from splitk_gemm import Config, splitk_mm

LAYERS = 28
TABLE = {  # (k, n) -> [(max rows, Config)], from splitk_bench's sweep (session 15 call 4)
    (2048, 1024): [(16, Config(16, 32, 128, 4, 4, 3)), (32, Config(32, 32, 128, 4, 4, 3)), (64, Config(64, 32, 64, 4, 4, 4)),
                   (256, Config(64, 32, 64, 1, 4, 4))],
    (3072, 1024): [(16, Config(16, 32, 64, 4, 4, 4)), (32, Config(32, 32, 128, 4, 4, 3)), (64, Config(64, 32, 64, 4, 4, 4)),
                   (128, Config(64, 32, 64, 2, 4, 4)), (256, Config(64, 32, 64, 1, 4, 4))],
    (1024, 4096): [(16, Config(16, 32, 64, 1, 4, 4)), (32, Config(32, 32, 128, 1, 4, 3)), (64, Config(64, 32, 64, 1, 4, 4)),
                   (128, Config(64, 64, 64, 1, 4, 4)), (256, Config(64, 128, 64, 1, 4, 4))],
    (1024, 6144): [(16, Config(16, 64, 256, 1, 4, 3)), (32, Config(32, 64, 128, 1, 4, 4)), (64, Config(64, 64, 64, 1, 4, 4)),
                   (128, Config(64, 128, 64, 1, 4, 4)), (256, Config(128, 128, 64, 1, 4, 3))],
}


def cfg_for(rows, w):
    n, k = w.shape
    return next(c for r, c in TABLE[(k, n)] if rows <= r)


def main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    mk = lambda n, k: torch.randn(n, k, device=dev, dtype=dt) * 0.03  # noqa: E731
    layers = [dict(qkv=mk(4096, 1024), o=mk(1024, 2048), gu=mk(6144, 1024), d=mk(1024, 3072),
                   n1=torch.ones(1024, device=dev, dtype=dt), n2=torch.ones(1024, device=dev, dtype=dt)) for _ in range(LAYERS)]
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,8,16,32,64,128,192,256").split(",")]
    for rows in rows_list:
        x0 = torch.randn(rows, 1024, device=dev, dtype=dt)
        res0 = torch.randn(rows, 1024, device=dev, dtype=dt)
        x, res = x0.clone(), res0.clone()
        results = {}
        for mode in ("cublas", "triton", "triton+pdl", "triton+pdl+prefetch", "cublas2"):
            def mm(a, w):
                if mode.startswith("cublas"):
                    return a @ w.t()
                return splitk_mm(a, w, cfg_for(rows, w), pdl="pdl" in mode, prefetch="prefetch" in mode)

            def chain():
                h = x
                for L in layers:
                    flashinfer.norm.fused_add_rmsnorm(h, res, L["n1"], 1e-6)
                    qkv = mm(h, L["qkv"])
                    o = mm(qkv[:, :2048], L["o"])
                    flashinfer.norm.fused_add_rmsnorm(o, res, L["n2"], 1e-6)
                    a = flashinfer.activation.silu_and_mul(mm(o, L["gu"]))
                    h = mm(a, L["d"])
                return h

            x.copy_(x0)
            res.copy_(res0)
            out = chain().float()
            for _ in range(2):
                chain()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(5):
                s.record()
                for _ in range(10):
                    g.replay()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) / 10 * 1000)
            results[mode] = (min(times), out)
            del g
        ref = results["cublas"][1]
        line = " ".join(f"{m}={t:.1f}us(d={(o - ref).abs().max().item() / ref.abs().max().item():.2g})" for m, (t, o) in results.items())
        print(f"rows={rows}: {line}", flush=True)


if __name__ == "__main__":
    main()
