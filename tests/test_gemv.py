"""layers/gemv.py on a CUDA GPU: the one-row GEMV against a float64 product, CpuGemm's routing of one-row calls,
and tune() choosing per weight shape (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n, k", [(1024, 2048), (4096, 1024), (1000, 1000), (7, 96)])  # odd sizes: masked tails
@pytest.mark.parametrize("config", [(4, 1024, 4), (8, 512, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_is_the_product_in_fp32_rounded_once(n, k, config, with_bias):
    from minisgl.layers.gemv import GemvConfig, gemv

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    y = gemv(x, w, b, GemvConfig(*config))
    exact = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    # fp32 sums of bf16 products, one rounding to bf16 at the end
    bound = exact.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * 2**-16 + 1e-6
    assert ((y.double() - exact).abs() <= bound).all()


def test_cpu_gemm_sends_only_one_row_calls_to_the_gemv():
    from minisgl.layers.gemv import GemvConfig
    from minisgl.layers.linear import CpuGemm

    torch.manual_seed(1)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    gemm = CpuGemm()
    gemm.gemv = GemvConfig(4, 256, 4)
    one, three = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16), torch.randn(3, 256, device="cuda").bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gemm(one, w)
        torch.cuda.synchronize()
    assert any("gemv_kernel" in e.name for e in prof.events())
    torch.testing.assert_close(gemm(three, w), torch.nn.functional.linear(three, w), rtol=0, atol=0)  # cuBLAS


def test_tune_decides_per_shape_once_and_skips_large_weights(tiny_model_dir):
    from minisgl.layers import gemv
    from minisgl.layers.linear import CpuGemm
    from minisgl.models.loader import load_model

    model, _ = load_model(tiny_model_dir("qwen3"), dtype=torch.bfloat16, device="cuda")
    tuned = gemv.tune(model)
    gemms = [m for m in model.modules() if isinstance(getattr(m, "gemm", None), CpuGemm)]
    assert tuned == sum(m.gemm.gemv is not None for m in gemms)
    by_shape: dict[tuple[int, ...], set] = {}
    for m in gemms:
        by_shape.setdefault(tuple(m.weight.shape), set()).add(m.gemm.gemv)
    assert all(len(choices) == 1 for choices in by_shape.values())  # one decision per weight shape
