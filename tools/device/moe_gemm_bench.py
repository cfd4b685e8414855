"""One rank's fused MoE at tensor parallelism P=2: experts split (moe_parallel "tp") against whole experts ("ep").

    python3 tools/device/moe_gemm_bench.py [--out moe_gemm.json] [--tokens 1,64,256,1024,8192]

Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768, bf16) with random weights and
random router logits. For each token count, microseconds of layers/fused_moe.py's fused_moe (routing, grouping,
both grouped GEMMs, the top-k sum), replayed 20 times from a CUDA graph, for:
  full  P=1, the whole layer: 128 experts, I=768;
  tp    one rank of P=2 under the expert split: 128 experts, I=384;
  ep0   one rank of P=2 under expert parallelism: experts 0..63, I=768;
  ep1   the same with experts 64..127.
A P=2 layer waits for its slower rank at the all-reduce (not timed here: the same for both layouts), so the table
compares tp with max(ep0, ep1). Random logits spread the tokens evenly over the experts; a trained router is less
even, which costs EP (its busiest rank sets the pace) and not TP.

Before timing, the ranks' partial sums are checked against the whole layer on 256 tokens: ep0 + ep1 and
tp rank 0 + tp rank 1 must both give the P=1 output (bf16 rounding aside).
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us

from minisgl.layers.fused_moe import fused_moe

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """(gate_up, down, expert_offset) of each layout, cut from one random full layer as the weight loader cuts it."""
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    half, local = INTER // 2, EXPERTS // 2
    out = {"full": (gate_up, down, 0)}
    for rank in (0, 1):
        cols = slice(rank * half, (rank + 1) * half)  # rank's slice of I: its gate rows, then its up rows
        tp_gate_up = torch.cat([gate_up[:, :INTER][:, cols], gate_up[:, INTER:][:, cols]], dim=1).contiguous()
        out[f"tp{rank}"] = (tp_gate_up, down[:, :, cols].contiguous(), 0)
        mine = slice(rank * local, (rank + 1) * local)
        out[f"ep{rank}"] = (gate_up[mine], down[mine], rank * local)
    return out


def run(x: torch.Tensor, logits: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    gate_up, down, offset = layout
    return fused_moe(x, logits, gate_up, down, TOP_K, True, expert_offset=offset)


def check(weights: dict[str, tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, float]:
    """Largest error of each layout's two ranks summed against the whole layer, relative to its largest output."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(256, EXPERTS, device="cuda", dtype=torch.bfloat16, generator=g)
    want = run(x, logits, weights["full"]).float()
    errors = {}
    for name in ("tp", "ep"):
        got = run(x, logits, weights[f"{name}0"]).float() + run(x, logits, weights[f"{name}1"]).float()
        errors[name] = ((got - want).abs().max() / want.abs().max()).item()
        print(f"check: {name} ranks summed vs the whole layer, max error / max output = {errors[name]:.2e}")
        assert errors[name] < 2e-2, f"{name} ranks do not add up to the whole layer"
    return errors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64,256,1024,8192")
    p.add_argument("--out", default="moe_gemm.json")
    args = p.parse_args()
    weights = layouts()
    errors = check(weights)
    rows = []
    print(f"{'tokens':>6s} {'full us':>9s} {'tp us':>9s} {'ep0 us':>9s} {'ep1 us':>9s} {'ep/tp':>6s}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
        us = {name: graph_us(lambda w=w: run(x, logits, w), 20) for name, w in weights.items() if name != "tp1"}  # noqa: B023
        ep = max(us["ep0"], us["ep1"])
        rows.append({"tokens": tokens, **{f"{k}_us": v for k, v in us.items()}, "ep_over_tp": ep / us["tp0"]})
        print(
            f"{tokens:6d} {us['full']:9.1f} {us['tp0']:9.1f} {us['ep0']:9.1f} {us['ep1']:9.1f} {ep / us['tp0']:6.2f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "check": errors, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
