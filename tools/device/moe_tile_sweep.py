"""The grouped MoE GEMMs' tilings swept by token count, against the tiles layers/fused_moe.py picks now.

    python3 tools/device/moe_tile_sweep.py [--tokens 16,64,128,236,16384] [--out moe_tile_sweep.json]

Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768, bf16), random weights and router
logits; microseconds per call from a CUDA graph (tools/device/graph_timing.py). For each token count and each GEMM
(the gate-up GEMM as fused_moe runs it there: with SiLU-and-mul in its epilogue where gated_config says so, else
plain; the down GEMM with the routing weights) every tiling of the grid runs on the grouping of its own BLOCK_M, its
output is checked against the current tiles' output, and the five fastest are printed beside the current one.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from graph_timing import graph_us
from moe_grouped_bench import EXPERTS, HIDDEN, INTER, TOP_K, random_experts

from minisgl.layers import fused_moe as fm


def grid(tokens: int) -> list[dict[str, int]]:
    """The tilings tried: decode-sized row blocks below 1,024 tokens, prefill-sized ones above."""
    if tokens < 1024:
        shapes = itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256), (4,), (3, 4, 5), (1,))
    else:
        shapes = itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4), (8,))
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M")
    configs = [dict(zip(keys, s)) for s in shapes]
    per_expert = tokens * TOP_K / EXPERTS
    return [c for c in configs if c["BLOCK_M"] <= max(32, 4 * per_expert)]


def sweep(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[dict]:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
    weights, ids = fm.route_topk(logits, TOP_K, True)
    pairs = tokens * TOP_K
    current = fm.block_config(tokens, TOP_K, EXPERTS)
    gated_now = fm.gated_config(current, expert_parallel=False) is not None
    width = INTER if gated_now else 2 * INTER
    act = torch.randn(pairs, INTER, device="cuda", dtype=torch.bfloat16)
    up_out = torch.empty(pairs, width, device="cuda", dtype=torch.bfloat16)
    down_out = torch.empty(pairs, HIDDEN, device="cuda", dtype=torch.bfloat16)
    groupings: dict[int, tuple] = {}

    def run(config: dict[str, int], which: str) -> None:
        g = groupings.setdefault(config["BLOCK_M"], fm.align_by_expert(ids, EXPERTS, config["BLOCK_M"]))
        if which == "gate_up":
            fm._grouped_gemm(x, gate_up, up_out, weights, g, TOP_K, False, config, None, gated_now)
        else:
            fm._grouped_gemm(act, down, down_out, weights, g, 1, True, config)

    rows = []
    for which, out in (("gate_up", up_out), ("down", down_out)):
        now = fm.gated_config(current, False) if which == "gate_up" and gated_now else current
        run(now, which)
        want = out.float().clone()
        timed = []
        for config in [now] + [c for c in grid(tokens) if c != now]:
            try:
                out.fill_(float("nan"))
                run(config, which)
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                us = graph_us(lambda: run(config, which), 10)
            except Exception as e:  # out of shared memory or registers: not a candidate
                print(f"  {which} {config}: {type(e).__name__}", flush=True)
                continue
            assert err < 1e-2, f"{tokens} tokens, {which}, {config}: off by {err:.2e}"
            timed.append({"config": config, "us": us, "current": config == now})
        timed.sort(key=lambda t: t["us"])
        cur = next(t for t in timed if t["current"])
        print(f"{tokens:6d} {which:8s} current {cur['us']:8.1f} us {cur['config']}", flush=True)
        for t in timed[:5]:
            print(f"{'':6s} {'':8s} {t['us']:16.1f} us {t['config']} ({cur['us'] / t['us']:.3f}x)", flush=True)
        rows.append({"tokens": tokens, "gemm": which, "gated": which == "gate_up" and gated_now, "timed": timed})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,128,236,16384")
    p.add_argument("--out", default="moe_tile_sweep.json")
    args = p.parse_args()
    gate_up, down = random_experts()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        rows += sweep(tokens, gate_up, down)
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
