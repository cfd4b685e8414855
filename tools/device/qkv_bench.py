"""GPU time of the fused q/k-norm + RoPE + KV-store kernel (layers/fused_qkv.py) by token count and program shape.

The Qwen3-0.6B shape (16 query / 8 KV heads x 128, q/k norms), bf16, the KV slots of a decode batch scattered at
random and a prefill's contiguous. Each (tokens per program, warps) is timed from a CUDA graph of 10 calls and
compared with the default shape's output (max abs difference); GB/s counts the bytes read (qkv) and written (q, k, v).

    python3 tools/device/qkv_bench.py [--tokens 1,64,256,2048,16384] [--shapes 1x1,4x2,8x4,16x4]   # after env.sh
"""

from __future__ import annotations

import argparse

import torch


def graph_us(fn, calls: int = 10, reps: int = 5) -> float:
    """µs per call, replayed from a CUDA graph of `calls` calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * reps)


def main() -> None:
    from minisgl.layers import RotaryEmbedding
    from minisgl.layers.fused_qkv import block_config, fused_qkv

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,128,256,512,2048,16384")
    p.add_argument("--shapes", default="1x1,2x1,4x1,4x2,8x2,8x4,16x4,32x4,16x8")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads, dim = 16, 8, 128
    rotary = RotaryEmbedding(dim, 40960, 1e6).to(dev)
    norms = [torch.rand(dim, device=dev) + 0.5 for _ in range(2)]
    slots = 600_000
    k_cache = torch.zeros(slots, kv_heads, dim, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=dev, dtype=dt)
        pos = torch.randint(0, 2048, (tokens,), device=dev)
        loc = torch.randperm(slots, device=dev)[:tokens] if tokens <= 256 else torch.arange(tokens, device=dev) + 1000
        q = torch.empty(tokens, heads, dim, device=dev, dtype=dt)
        nbytes = qkv.numel() * 2 * 2  # read once, written once (q + k + v)

        def call(tb: int | None = None, warps: int | None = None) -> None:
            fused_qkv(
                qkv,
                pos,
                rotary.cos_sin(),
                *norms,
                1e-6,
                k_cache,
                v_cache,
                loc,
                heads,
                kv_heads,
                dim,
                out=q,
                block_tokens=tb,
                num_warps=warps,
            )

        call()
        ref = (q.clone(), k_cache[loc].clone(), v_cache[loc].clone())
        row = []
        for shape in args.shapes.split(","):
            tb, warps = (int(x) for x in shape.split("x"))
            q.zero_()
            k_cache[loc] = 0
            call(tb, warps)
            # the norm's sum runs in another order per shape: float32 rounding, an ulp of bf16 at most
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip((q, k_cache[loc], v_cache[loc]), ref))
            us = graph_us(lambda: call(tb, warps))
            row.append(f"{shape}: {us:7.1f} µs {nbytes / us / 1e3:6.0f} GB/s err {err:.0e}")
        print(
            f"tokens {tokens:6d} (default {'x'.join(map(str, block_config(tokens)))}): " + " | ".join(row), flush=True
        )


if __name__ == "__main__":
    main()
