"""fused_moe's Triton grouped GEMMs against PyTorch's CUTLASS grouped GEMM (`torch._grouped_mm`) by token count.

    python3 tools/device/moe_grouped_mm_bench.py [--tokens 16,64,236,1024,4096,16384] [--out moe_grouped_mm.json]

Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768, bf16), random weights and router
logits; microseconds per call from a CUDA graph (tools/device/graph_timing.py), for each token count:
  triton gate-up   layers/fused_moe.py's gate-up GEMM as fused_moe runs it: SiLU-and-mul in its epilogue where
                   gated_config gives tiles, else the GEMM then SiLU-and-mul;
  triton down      its down GEMM (rows scaled by the routing weights);
  grouped_mm       torch._grouped_mm over rows already in expert order, each expert's run padded to 16 rows (its
                   offsets): gate-up, then SiLU-and-mul, then down; and the gather that puts x's rows in that order
                   (fused_moe's GEMMs read them in place, through the grouping's sorted ids).
Before timing, grouped_mm's SiLU-and-mul output is compared with the Triton one, row for row.
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import graph_us
from moe_grouped_bench import EXPERTS, HIDDEN, INTER, TOP_K, random_experts

from minisgl.layers import fused_moe as fm
from minisgl.layers.activation import SiluAndMul


def expert_order(ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dest [pairs]: each pair's row in expert order, offs [E] int32: each expert's padded run's end, rows)."""
    flat = ids.flatten().long()
    counts = torch.bincount(flat, minlength=EXPERTS)
    padded = (counts + pad - 1) // pad * pad
    offs = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(flat.numel(), device=flat.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    dest = torch.empty_like(flat)
    dest[order] = (offs - padded)[flat[order]] + rank
    return dest, offs.to(torch.int32), int(offs[-1].item())


def row(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, float]:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
    weights, ids = fm.route_topk(logits, TOP_K, True)
    config = fm.block_config(tokens, TOP_K, EXPERTS)
    gated = fm.gated_config(config, expert_parallel=False)
    grouping = fm.align_by_expert(ids, EXPERTS, config["BLOCK_M"])
    pairs = tokens * TOP_K
    act = torch.empty(pairs, INTER, device="cuda", dtype=torch.bfloat16)
    wide = torch.empty(pairs, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(pairs, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def triton_gate_up() -> torch.Tensor:
        if gated is not None:
            fm._grouped_gemm(x, gate_up, act, weights, grouping, TOP_K, False, gated, None, True)
            return act
        fm._grouped_gemm(x, gate_up, wide, weights, grouping, TOP_K, False, config)
        return SiluAndMul()(wide)

    act = triton_gate_up().clone()
    r = {"tokens": tokens, "triton_gate_up_us": graph_us(triton_gate_up, 10)}
    r["triton_down_us"] = graph_us(lambda: fm._grouped_gemm(act, down, out, weights, grouping, 1, True, config), 10)
    dest, offs, rows = expert_order(ids, 16)
    source = torch.arange(pairs, device="cuda") // TOP_K
    xs = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    xs[dest] = x[source]
    gu_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, H, 2I] and [E, I, H], as F.linear reads them
    wide_s = torch._grouped_mm(xs, gu_t, offs=offs)
    act_s = SiluAndMul()(wide_s)
    error = ((act_s[dest].float() - act.float()).abs().max() / act.float().abs().max()).item()
    assert error < 1e-2, f"{tokens} tokens: grouped_mm's activations are off by {error:.2e} of the largest"
    r["grouped_mm_gate_up_us"] = graph_us(lambda: torch._grouped_mm(xs, gu_t, offs=offs), 10)
    r["grouped_mm_silu_us"] = graph_us(lambda: SiluAndMul()(wide_s), 10)
    r["grouped_mm_down_us"] = graph_us(lambda: torch._grouped_mm(act_s, down_t, offs=offs), 10)
    r["gather_us"] = graph_us(lambda: torch.index_select(x, 0, source), 10)
    r["triton_us"] = r["triton_gate_up_us"] + r["triton_down_us"]
    r["grouped_mm_us"] = sum(r[k] for k in ("grouped_mm_gate_up_us", "grouped_mm_silu_us", "grouped_mm_down_us"))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,236,1024,4096,16384")
    p.add_argument("--out", default="moe_grouped_mm.json")
    args = p.parse_args()
    gate_up, down = random_experts()
    print(f"{'tokens':>6s} {'triton gate-up / down':>22s} {'grouped_mm gate-up / SiLU / down':>34s} {'gather':>8s}")
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        r = row(tokens, gate_up, down)
        rows.append(r)
        print(
            f"{tokens:6d} {r['triton_gate_up_us']:10.1f} / {r['triton_down_us']:8.1f}"
            f" {r['grouped_mm_gate_up_us']:14.1f} / {r['grouped_mm_silu_us']:6.1f} / {r['grouped_mm_down_us']:8.1f}"
            f" {r['gather_us']:8.1f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
