"""One token through a mixture-of-experts layer: layers/moe_gemv.py's two kernels against layers/fused_moe.py's
grouped path, and moe_gemv's tiles.

    python3 tools/device/moe_gemv_bench.py [--layers 4]

Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768, bf16) with random weights and router
logits; `--layers` copies of them, a call on each in turn, so that consecutive calls do not find their experts in
L2. Microseconds per call from a CUDA graph (tools/device/graph_timing.py) and the GB/s of the top_k experts'
weights each call reads. First the two paths' outputs are compared (bf16 rounding aside), then each kernel's tiles,
(BLOCK_N, BLOCK_K, num_warps), are timed apart (moe_gemv.UP_CONFIG / DOWN_CONFIG hold the chosen ones).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from graph_timing import graph_us

from minisgl.layers import fused_moe, moe_gemv

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
UP_TILES = ((1, 1024, 4), (2, 512, 4), (2, 1024, 4), (2, 1024, 8), (4, 256, 4), (4, 512, 4), (4, 512, 8), (8, 256, 4))
DOWN_TILES = ((1, 256, 4), (2, 256, 4), (4, 256, 4), (4, 128, 4), (8, 128, 4), (2, 512, 4), (4, 256, 8), (8, 256, 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="copies of the experts, called in turn")
    args = p.parse_args()
    torch.manual_seed(0)
    dt, n = torch.bfloat16, args.layers
    gate_up = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dt, device="cuda") * 0.02 for _ in range(n)]
    down = [torch.randn(EXPERTS, HIDDEN, INTER, dtype=dt, device="cuda") * 0.02 for _ in range(n)]
    logits = [torch.randn(1, EXPERTS, dtype=dt, device="cuda") for _ in range(n)]
    x = torch.randn(1, HIDDEN, dtype=dt, device="cuda")
    act = torch.randn(TOP_K, INTER, dtype=dt, device="cuda")

    def rotating(call):  # each captured call on the next copy of the experts
        turn = itertools.count()
        return lambda: call(next(turn) % n)

    enabled = moe_gemv.ENABLED
    moe_gemv.ENABLED = False
    grouped = fused_moe.fused_moe(x, logits[0], gate_up[0], down[0], TOP_K, True)
    grouped_us = graph_us(rotating(lambda i: fused_moe.fused_moe(x, logits[i], gate_up[i], down[i], TOP_K, True)))
    moe_gemv.ENABLED = enabled
    ours = moe_gemv.moe_gemv(x, logits[0], gate_up[0], down[0], TOP_K, True)
    diff = (ours.float() - grouped.float()).abs().max().item()
    print(f"grouped path {grouped_us:.1f} us a layer; moe_gemv's output differs by at most {diff:.2e} "
          f"(mean |output| {grouped.float().abs().mean().item():.2e})")  # fmt: skip
    up_bytes, down_bytes = TOP_K * 2 * HIDDEN * INTER * 2, TOP_K * HIDDEN * INTER * 2
    for tiles in UP_TILES:
        us = graph_us(rotating(lambda i, c=tiles: moe_gemv.up(x, logits[i], gate_up[i], TOP_K, True, c)))
        print(f"up   {tiles}: {us:6.1f} us {up_bytes / us / 1e3:6.0f} GB/s")
    for tiles in DOWN_TILES:
        us = graph_us(rotating(lambda i, c=tiles: moe_gemv.down_sum(act, logits[i], down[i], TOP_K, True, None, c)))
        print(f"down {tiles}: {us:6.1f} us {down_bytes / us / 1e3:6.0f} GB/s")
    default_us = graph_us(rotating(lambda i: moe_gemv.moe_gemv(x, logits[i], gate_up[i], down[i], TOP_K, True)))
    print(f"moe_gemv at its defaults (up {moe_gemv.UP_CONFIG}, down {moe_gemv.DOWN_CONFIG}): {default_us:.1f} us")


if __name__ == "__main__":
    main()
