"""layers/gemv.py's one-row kernel with the RMSNorm before it (and SiLU-and-mul after it) against float64 PyTorch
math: the norm's sum and the residual it hands on, the product, and the gate x up of a gate_up projection.

On a CUDA machine it runs compiled; on any machine with Triton it also runs in Triton's interpreter (TRITON_INTERPRET=1,
numpy on the CPU) in a process of its own (tests/triton_interpreter.py), so CI checks the kernel without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import device_fixture, run_interpreter_cases

# The relative error of a rounding to bf16: half a unit in the last place on the GPU (to nearest); Triton's interpreter
# truncates (a whole unit).
ROUNDING = {"cuda": 2**-8, "cpu": 2**-7}
CASES = [  # (n, k, block) : a K split over several blocks, masked tails in N and K
    (96, 256, (4, 256, 4)),
    (37, 200, (8, 64, 4)),
    (9, 300, (1, 128, 4)),  # one output row a program (tune's narrow tiles)
    (37, 200, (2, 64, 4, True)),  # 2-4 rows: the products summed after the last block
]


def test_the_kernel_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=2 * 4 * len(CASES) + 1, timeout=600)


device = device_fixture("minisgl.layers.gemv", "_kernel")


@pytest.fixture(autouse=True)
def _rows_kernel_built_per_device():
    """The kernel of 2-4 rows is cached apart from the one-row kernel (device clears that one): cleared likewise."""
    from minisgl.layers import gemv

    gemv._rows_kernel.cache_clear()
    yield
    gemv._rows_kernel.cache_clear()


def reference(x, residual, norm_w, eps, w, bias, gated):
    """float64 math, rounded to bf16 where the unfused kernels round (the sum, the norm, the GEMM's output)."""
    s = x.double() + (residual.double() if residual is not None else 0)
    res_out = s.to(x.dtype)
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()).to(x.dtype).double()
    y = normed @ w.double().T + (bias.double() if bias is not None else 0)
    if gated:
        gate, up = y.to(x.dtype).double().chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    bound_of = normed.abs() @ w.double().abs().T
    if gated:
        bound_of = bound_of.chunk(2, dim=-1)[0] * up.abs() + bound_of.chunk(2, dim=-1)[1] * gate.abs()
    return y, res_out, bound_of


@pytest.mark.parametrize("n, k, block", CASES)
@pytest.mark.parametrize(
    "with_residual, gated, with_bias",
    [(True, False, False), (False, False, True), (True, True, False), (False, True, False)],
    ids=["add-norm", "norm-bias", "add-norm-gated", "norm-gated"],
)
@pytest.mark.parametrize("m", [1, 3], ids=["one-row", "three-rows"])
def test_norm_gemv_matches_float64_math(device, m, n, k, block, with_residual, gated, with_bias):
    from minisgl.layers.gemv import GemvConfig, norm_gemv

    g = torch.Generator().manual_seed(n + k)
    dtype = torch.bfloat16
    x = torch.randn(m, k, generator=g).to(device, dtype)
    residual = torch.randn(m, k, generator=g).to(device, dtype) if with_residual else None
    residual_before = residual.clone() if residual is not None else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
    w = (torch.randn(2 * n if gated else n, k, generator=g) * 0.05).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    y, res_out = norm_gemv(x, residual, norm_w, 1e-6, w, bias, GemvConfig(*block), gated=gated)

    cpu = [t.cpu() if t is not None else None for t in (x, residual_before, norm_w, w, bias)]
    exact, exact_res, scale = reference(*cpu[:3], 1e-6, *cpu[3:], gated)
    ulp = ROUNDING[device]
    assert y.shape == (m, n) and y.dtype == dtype
    if with_residual:
        assert torch.equal(residual, residual_before)  # the residual' is written out of place
        torch.testing.assert_close(res_out.cpu().double(), exact_res.double(), rtol=ulp, atol=0)
    else:
        assert res_out is x  # the un-normed input is the residual
    # fp32 sums of bf16 products, the norm's rounding, one rounding of the result (and of gate and up)
    bound = exact.abs() * 2 * ulp + scale * 2 * ulp + 1e-5
    assert ((y.cpu().double() - exact).abs() <= bound).all()


def test_plain_gemv_is_the_same_kernel_without_the_norm(device):
    from minisgl.layers.gemv import GemvConfig, gemv

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(37, 200, generator=g) * 0.05).to(device, torch.bfloat16)
    y = gemv(x, w, None, GemvConfig(8, 64, 4))
    exact = x.cpu().double() @ w.cpu().double().T
    bound = exact.abs() * ROUNDING[device] + (x.cpu().double().abs() @ w.cpu().double().abs().T) * 2**-16 + 1e-6
    assert ((y.cpu().double() - exact).abs() <= bound).all()
