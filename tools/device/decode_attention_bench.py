"""FlashInfer's decode attention variants on a paged bf16 KV cache, per layer, by batch size.

The cache has pages of 16 scattered at random over the pool; each request holds 100-1,324 tokens (a prompt of
100-1,024 and up to 300 generated, as the offline workload's steady batches). Variants: the tensor-core decode
minisgl runs (`tc`, split-KV as FlashInfer's planner decides; `tc-nosplit`), the same with each request's KV cut into
fixed chunks of N pages (`fsN`), the CUDA-core decode (`cc`) and the persistent `BatchAttention` kernel
(`persistent`, with its largest difference from `tc`). Each is timed from a CUDA graph of 8 calls (graph_timing.py);
TB/s counts the KV read.

    python3 tools/device/decode_attention_bench.py [--heads 32x4,16x8] [--batch 236,128,64,24]   # after env.sh
"""

from __future__ import annotations

import argparse
import random

import torch
from graph_timing import graph_us

PAGE = 16
HEAD_DIM = 128


def batch(qo_heads: int, kv_heads: int, bs: int, seed: int = 0) -> dict:
    """A decode batch's paged layout, cache and queries."""
    rng = random.Random(seed)
    lens = [rng.randint(100, 1024) + rng.randint(0, 300) for _ in range(bs)]
    pages = [-(-n // PAGE) for n in lens]
    total = sum(pages)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return dict(
        lens=lens,
        indptr=indptr,
        indices=torch.randperm(total + 64, device="cuda", dtype=torch.int32)[:total],
        last=torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32, device="cuda"),
        cache=torch.randn(total + 64, 2, PAGE, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        q=torch.randn(bs, qo_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
    )


def decode_variants(b: dict, qo_heads: int, kv_heads: int, workspace: torch.Tensor, splits: list[int]) -> dict:
    """µs of each BatchDecodeWithPagedKVCacheWrapper variant, and the tensor-core decode's output."""
    import flashinfer  # lazy: GPU-only

    variants = [("tc", True, None, False), ("tc-nosplit", True, None, True), ("cc", False, None, False)]
    variants += [(f"fs{n}", True, n, False) for n in splits]
    res, ref = {}, None
    for name, tensor_cores, fixed, nosplit in variants:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(
            b["indptr"], b["indices"], b["last"], qo_heads, kv_heads, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16, fixed_split_size=fixed, disable_split_kv=nosplit,
        )  # fmt: skip
        out = torch.empty_like(b["q"])
        if ref is None:
            ref = wrapper.run(b["q"], b["cache"])
        res[name] = graph_us(lambda w=wrapper, o=out: w.run(b["q"], b["cache"], out=o), reps=8)
    return res, ref


def persistent(b: dict, qo_heads: int, kv_heads: int, ref: torch.Tensor) -> tuple[float, float]:
    """µs of flashinfer's BatchAttention on the same batch, and its largest difference from ref."""
    import flashinfer  # lazy: GPU-only

    bs = b["q"].shape[0]
    attn = flashinfer.attention.BatchAttention("NHD")
    attn.plan(
        torch.arange(bs + 1, dtype=torch.int32, device="cuda"), b["indptr"], b["indices"],
        torch.tensor(b["lens"], dtype=torch.int32, device="cuda"), qo_heads, kv_heads, HEAD_DIM, HEAD_DIM, PAGE,
        causal=False, sm_scale=HEAD_DIM**-0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip
    out, _ = attn.run(b["q"], b["cache"])
    err = (out.float() - ref.float()).abs().max().item()
    out = torch.empty_like(b["q"])
    lse = torch.empty(bs, qo_heads, dtype=torch.float32, device="cuda")
    return graph_us(lambda: attn.run(b["q"], b["cache"], out=out, lse=lse), reps=8), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="32x4,16x8", help="query x KV heads (30B-A3B: 32x4, 0.6B: 16x8)")
    parser.add_argument("--batch", default="236,128,64,24")
    parser.add_argument("--splits", default="8,16,32,64", help="fixed KV chunks in pages ('' for none)")
    args = parser.parse_args()
    workspace = torch.empty(1536 << 20, dtype=torch.uint8, device="cuda")  # fixed small chunks need ~400 MB
    splits = [int(n) for n in args.splits.split(",") if n]
    print(torch.cuda.get_device_name())
    for heads in args.heads.split(","):
        qo_heads, kv_heads = (int(n) for n in heads.split("x"))
        for bs in (int(n) for n in args.batch.split(",")):
            b = batch(qo_heads, kv_heads, bs)
            kv_gb = sum(b["lens"]) * kv_heads * HEAD_DIM * 2 * 2 / 1e9
            res, ref = decode_variants(b, qo_heads, kv_heads, workspace, splits)
            res["persistent"], err = persistent(b, qo_heads, kv_heads, ref)
            cells = " ".join(f"{name} {us:.1f} us ({kv_gb / us * 1e3:.2f} TB/s)" for name, us in res.items())
            head = f"{qo_heads}/{kv_heads} heads, {bs} requests, KV {kv_gb * 1e3:.0f} MB"
            print(f"{head}: {cells}; persistent max diff {err:.3g}")


if __name__ == "__main__":
    main()
