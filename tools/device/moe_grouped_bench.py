"""The grouped MoE path's pieces by token count: SiLU-and-mul in the gate-up GEMM against after it, and the grouping
by expert in one launch (a program per expert) against three kernels.

    python3 tools/device/moe_grouped_bench.py [--tokens 16,64,236,1024,4096,16384] [--out moe_grouped.json]

Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768, bf16) with random weights and random
router logits; microseconds per call from a CUDA graph (tools/device/graph_timing.py), for each token count:
  gate-up + SiLU   layers/fused_moe.py's grouped GEMM writing [pairs, 2I], then SiLU-and-mul (layers/activation.py);
  gated            the same GEMM with SiLU-and-mul in its epilogue (fused_moe.gated_config: where fused_moe runs it),
                   writing [pairs, I], with gated_config's tiles at every token count;
  down             the down projection's grouped GEMM;
  top-k sum        each token's top_k rows of the down output summed: torch.sum / fused_moe.topk_sum (a Triton kernel);
  grouping         align_by_expert in one launch (up to fused_moe.ONE_LAUNCH_PAIRS pairs) and in three kernels;
  layer            the whole fused_moe (routing, grouping, both GEMMs, the top-k sum).
Before each row's timing the gated output is compared with GEMM + SiLU-and-mul, and fused_moe's output in one launch
and in three kernels (equal: the rows of an expert's run are independent, whatever their order).
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us

from minisgl.layers import fused_moe as fm
from minisgl.layers.activation import SiluAndMul

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def random_experts() -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]): the layer's experts, random bf16 on the GPU (seed 0)."""
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    return gate_up, down


def row(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, float]:
    """One token count's timings and checks."""
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
    weights, ids = fm.route_topk(logits, TOP_K, True)
    config = fm.block_config(tokens, TOP_K, EXPERTS)
    gated = fm.gated_config(config, expert_parallel=True)  # its tiles (always given under expert parallelism)
    grouping = fm.align_by_expert(ids, EXPERTS, config["BLOCK_M"])
    pairs = tokens * TOP_K
    wide = torch.empty(pairs, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(pairs, INTER, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(pairs, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def unfused() -> torch.Tensor:
        fm._grouped_gemm(x, gate_up, wide, weights, grouping, TOP_K, False, config)
        return SiluAndMul()(wide)

    def fused() -> None:
        fm._grouped_gemm(x, gate_up, act, weights, grouping, TOP_K, False, gated, None, True)

    fused()
    want = unfused().float()
    gated_error = ((act.float() - want).abs().max() / want.abs().max()).item()
    assert gated_error < 1e-2, f"{tokens} tokens: the gated GEMM is off by {gated_error:.2e} of the largest output"
    r = {"tokens": tokens, "gated_error": gated_error}
    r["gate_up_silu_us"], r["gated_us"] = graph_us(unfused, 10), graph_us(fused, 10)
    r["down_us"] = graph_us(lambda: fm._grouped_gemm(act, down, out, weights, grouping, 1, True, config), 10)

    def torch_sum() -> torch.Tensor:
        return out.view(tokens, TOP_K, -1).sum(1)

    summed = {"kernel": fm.topk_sum(out, ids, 0, EXPERTS).float(), "torch": torch_sum().float()}
    r["topk_sum_torch_us"] = graph_us(torch_sum, 20)
    r["topk_sum_kernel_us"] = graph_us(lambda: fm.topk_sum(out, ids, 0, EXPERTS), 20)
    sum_error = ((summed["kernel"] - summed["torch"]).abs().max() / summed["torch"].abs().max()).item()
    assert sum_error < 1e-2, f"{tokens} tokens: the top-k sums differ by {sum_error:.2e} of the largest"
    layer = {}
    for name, limit in (("one_launch", fm.ONE_LAUNCH_PAIRS), ("three_kernels", 0)):
        if name == "one_launch" and pairs > limit:
            continue
        saved, fm.ONE_LAUNCH_PAIRS = fm.ONE_LAUNCH_PAIRS, limit
        try:
            r[f"grouping_{name}_us"] = graph_us(lambda: fm.align_by_expert(ids, EXPERTS, config["BLOCK_M"]), 20)
            r[f"layer_{name}_us"] = graph_us(lambda: fm.fused_moe(x, logits, gate_up, down, TOP_K, True), 10)
            layer[name] = fm.fused_moe(x, logits, gate_up, down, TOP_K, True)
        finally:
            fm.ONE_LAUNCH_PAIRS = saved
    if len(layer) == 2:
        assert torch.equal(layer["one_launch"], layer["three_kernels"]), f"{tokens} tokens: the groupings differ"
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,236,1024,4096,16384")
    p.add_argument("--out", default="moe_grouped.json")
    args = p.parse_args()
    gate_up, down = random_experts()
    print(
        f"{'tokens':>6s} {'gate-up+SiLU':>12s} {'gated':>8s} {'down':>8s} {'top-k sum t / k':>16s}"
        f" {'grouping 1 / 3':>16s} {'layer 1 / 3':>18s}"
    )
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        r = row(tokens, gate_up, down)
        rows.append(r)
        one = r.get("grouping_one_launch_us")
        grouping = f"{one:7.1f} / " if one is not None else "      - / "
        layer = f"{r['layer_one_launch_us']:8.1f} / " if one is not None else "       - / "
        print(
            f"{tokens:6d} {r['gate_up_silu_us']:12.1f} {r['gated_us']:8.1f} {r['down_us']:8.1f}"
            f" {r['topk_sum_torch_us']:7.1f} / {r['topk_sum_kernel_us']:6.1f}"
            f" {grouping}{r['grouping_three_kernels_us']:6.1f} {layer}{r['layer_three_kernels_us']:7.1f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
