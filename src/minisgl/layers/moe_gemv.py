"""One token through a mixture-of-experts layer on a GPU in two kernels: batch-1 decode.

layers/fused_moe.py's path takes eleven kernels a layer whatever the token count (routing, three to group the pairs
by expert, two grouped GEMMs, SiLU-and-mul, the top-k sum and their buffers' fills), each a launch of a few
microseconds, and at one token its grouped GEMM computes 16-row tiles for one row. Here instead:

- `moe_up_kernel`, program n-block: the block's gate and up rows of each of the token's top_k experts, SiLU-and-mul;
- `moe_down_kernel`, program n-block: the block's rows of each of the top_k experts' down projections, weighted by the
  routing weights and summed.

Each program routes the token itself from the router logits (a softmax and top-k over E values, as fused_moe's
route_kernel does), so no routing kernel runs either; both are GEMVs that read only the top_k experts' weights. The
roundings are the grouped path's: gate and up, the activation and each expert's weighted output in the model's
dtype, the top-k sum in float32. bf16/fp16 experts held whole on this rank (no FP8 scales, no expert parallelism).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minisgl import env
from minisgl.layers.fused import pdl_args

# (BLOCK_N, BLOCK_K, num_warps) of each kernel: the fastest of nine each for Qwen3-30B-A3B's experts on an H200
# (up 18.3 us, down 12.0 us a layer, against 43.1 us for the grouped path: docs/benchmarks.md).
UP_CONFIG = (2, 1024, 4)
DOWN_CONFIG = (2, 256, 4)
_DTYPES = (torch.bfloat16, torch.float16)
ENABLED = env.GEMV.get()  # MINISGL_GEMV=0: one token takes layers/fused_moe.py's grouped path too


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from minisgl.layers.moe_gemv_kernel import moe_down_kernel, moe_up_kernel  # lazy: imports triton (GPU-only)

    return moe_up_kernel, moe_down_kernel


def usable(x: torch.Tensor, num_local: int, num_experts: int, scaled: bool) -> bool:
    """Whether moe_gemv runs this layer's call: one token of a bf16/fp16 model, every expert here, no FP8 scales."""
    return x.shape[0] == 1 and x.dtype in _DTYPES and num_local == num_experts and not scaled and x.is_contiguous()


def moe_gemv(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    out: torch.Tensor | None = None,
    up_config: tuple[int, int, int] = UP_CONFIG,
    down_config: tuple[int, int, int] = DOWN_CONFIG,
) -> torch.Tensor:
    """fused_moe for one token x [1, H]: sum_k w_k * down[e_k] @ silu_and_mul(gate_up[e_k] @ x) over the top_k
    experts of router_logits [1, E]; gate_up [E, 2I, H] and down [E, H, I] contiguous. Written into out if given."""
    assert gate_up.is_contiguous() and down.is_contiguous() and router_logits.stride(-1) == 1
    act = up(x, router_logits, gate_up, top_k, renormalize, up_config)
    return down_sum(act, router_logits, down, top_k, renormalize, out, down_config)


def routing_blocks(num_experts: int, top_k: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_TOP) of moe_gemv_kernel.top_k_softmax: powers of two covering the experts and the top_k."""
    return max(16, 1 << (num_experts - 1).bit_length()), max(2, 1 << (top_k - 1).bit_length())


def _routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> dict[str, Any]:
    """The kernels' routing parameters: their routing is fused_moe's route_kernel's."""
    block_e, block_top = routing_blocks(router_logits.shape[1], top_k)
    return dict(TOP_K=top_k, RENORM=renormalize, BLOCK_E=block_e, BLOCK_TOP=block_top, **pdl_args(router_logits.device))


def up(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: tuple[int, int, int] = UP_CONFIG,
) -> torch.Tensor:
    """act [top_k, I]: silu_and_mul(gate_up[e_k] @ x) for each of the top_k experts e_k of the one token x [1, H]."""
    inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    bn, bk, warps = config
    _kernels()[0][(-(-inter // bn),)](
        router_logits, x, gate_up, act, router_logits.shape[1], inter, gate_up.stride(0), K=hidden, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, **_routing(router_logits, top_k, renormalize),
    )  # fmt: skip
    return act


def down_sum(
    act: torch.Tensor,
    router_logits: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int] = DOWN_CONFIG,
) -> torch.Tensor:
    """[1, H]: sum_k w_k * down[e_k] @ act[k] over the top_k experts of the token; into out if given."""
    hidden, inter = down.shape[1], down.shape[2]
    out = torch.empty(1, hidden, dtype=act.dtype, device=act.device) if out is None else out
    bn, bk, warps = config
    _kernels()[1][(-(-hidden // bn),)](
        router_logits, act, down, out, router_logits.shape[1], hidden, down.stride(0), K=inter, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, **_routing(router_logits, top_k, renormalize),
    )  # fmt: skip
    return out
