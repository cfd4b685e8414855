"""layers/moe_gemv.py, one token through the experts in two Triton kernels, against float64 PyTorch math routed by
layers/moe.py's `route` (torch.softmax + torch.topk), rounded where the grouped path rounds.

On a CUDA machine it runs compiled; on any machine with Triton it also runs in Triton's interpreter (TRITON_INTERPRET=1,
numpy on the CPU) in a process of its own (tests/triton_interpreter.py), so CI checks the kernels without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import device_fixture, run_interpreter_cases

# A rounding to bf16's relative error: half a unit in the last place on the GPU; Triton's interpreter truncates.
ROUNDING = {"cuda": 2**-8, "cpu": 2**-7}


def test_the_kernels_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=3, timeout=600)


device = device_fixture("minisgl.layers.moe_gemv", "_kernels")


def reference(x, logits, gate_up, down, top_k, renormalize):
    from minisgl.layers.moe import route

    weights, ids = route(logits, top_k, renormalize)
    dtype, inter = x.dtype, down.shape[2]
    total, scale = torch.zeros(x.shape[1], dtype=torch.float64), torch.zeros(x.shape[1], dtype=torch.float64)
    for weight, expert in zip(weights[0].double().tolist(), ids[0].tolist()):
        gu = (x.double() @ gate_up[expert].double().T)[0]
        gate, up = gu[:inter].to(dtype).double(), gu[inter:].to(dtype).double()
        act = (gate * torch.sigmoid(gate) * up).to(dtype).double()
        y = act @ down[expert].double().T * weight
        total += y.to(dtype).double()
        scale += (act.abs() @ down[expert].double().abs().T) * weight + y.abs()
    return total, scale


@pytest.mark.parametrize(
    "experts, top_k, hidden, inter, renormalize, configs",
    [
        (16, 4, 256, 96, True, ((4, 128, 4), (4, 32, 4))),  # K over several blocks
        (10, 3, 200, 40, False, ((8, 256, 4), (8, 64, 4))),  # masked tails: E, top_k, N and K not powers of two
    ],
    ids=["renorm", "tails"],
)
def test_one_token_through_the_experts_matches_float64_math(
    device, experts, top_k, hidden, inter, renormalize, configs
):
    from minisgl.layers.moe_gemv import moe_gemv

    g = torch.Generator().manual_seed(experts)
    dtype = torch.bfloat16
    x = torch.randn(1, hidden, generator=g).to(dtype)
    logits = torch.randn(1, experts, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    out = moe_gemv(*(t.to(device) for t in (x, logits, gate_up, down)), top_k, renormalize,
                   up_config=configs[0], down_config=configs[1])  # fmt: skip
    exact, scale = reference(x, logits, gate_up, down, top_k, renormalize)
    assert out.shape == (1, hidden) and out.dtype == dtype
    ulp = ROUNDING[device]
    bound = exact.abs() * ulp + scale * 4 * ulp + 1e-5
    assert ((out[0].cpu().double() - exact).abs() <= bound).all()


def test_fused_moe_takes_it_for_one_token_only(device):
    """layers/fused_moe.py's entry sends one bf16 token here; an FP8-scaled call or two tokens keep the grouped path."""
    from minisgl.layers.moe_gemv import usable

    one, two = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    assert usable(one, 8, 8, scaled=False)
    assert not usable(two, 8, 8, scaled=False)
    assert not usable(one, 8, 8, scaled=True)
    assert not usable(one, 4, 8, scaled=False)  # expert parallelism: half the experts here
    assert not usable(one.float(), 8, 8, scaled=False)
