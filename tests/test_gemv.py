"""layers/gemv.py: the one-row GEMV and the kernel of 2-4 rows against a float64 product, CpuGemm's routing of
calls by their rows, and tune() choosing per weight shape and bucket of rows.

The kernel of 2-4 rows also runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a process of its own:
tests/triton_interpreter.py); the rest needs a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import device_fixture, run_interpreter_cases

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The relative error of a rounding to bf16: half a unit in the last place on the GPU; Triton's interpreter truncates.
ROUNDING = {"cuda": 2**-8, "cpu": 2**-7}
ROWS_CASES = [  # (rows, n, k, block): a K over several blocks, masked tails in N and K, rows masked up to the bucket
    (2, 96, 256, (4, 256, 4)),
    (3, 37, 200, (2, 64, 4)),
    (4, 9, 300, (4, 128, 4)),
    (3, 37, 200, (2, 64, 4, True)),  # the products summed after the last block
]


def test_the_rows_kernel_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=2 * len(ROWS_CASES), timeout=600)


device = device_fixture("minisgl.layers.gemv", "_rows_kernel")


@pytest.mark.parametrize("m, n, k, block", ROWS_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_gemv_is_each_rows_product_in_fp32_rounded_once(device, m, n, k, block, with_bias):
    from minisgl.layers.gemv import GemvConfig, gemv

    g = torch.Generator().manual_seed(m + n + k)
    wide = torch.randn(m, k + 8, generator=g).to(device, torch.bfloat16)
    x = wide[:, :k]  # rows further apart than k: the kernel takes x's row stride
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, torch.bfloat16)
    b = torch.randn(n, generator=g).to(device, torch.bfloat16) if with_bias else None
    y = gemv(x, w, b, GemvConfig(*block))
    xd, wd = x.cpu().double(), w.cpu().double()
    exact = xd @ wd.T + (b.cpu().double() if with_bias else 0)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    bound = exact.abs() * ROUNDING[device] + (xd.abs() @ wd.abs().T) * 2**-16 + 1e-6
    assert ((y.cpu().double() - exact).abs() <= bound).all()


@needs_cuda
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


def _kernels_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "gemv" in e.name}


@needs_cuda
def test_cpu_gemm_sends_the_calls_of_its_row_buckets_to_the_gemv_and_the_rest_to_cublas():
    from minisgl.layers.gemv import GemvConfig
    from minisgl.layers.linear import CpuGemm

    torch.manual_seed(1)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    gemm = CpuGemm()
    gemm.gemv = {1: GemvConfig(4, 256, 4), 4: GemvConfig(2, 256, 4)}  # 2 rows: cuBLAS
    rows = {m: torch.randn(m, 256, device="cuda").bfloat16() for m in (1, 2, 3, 4, 5)}
    assert _kernels_run(lambda: gemm(rows[1], w)) == {"gemv_kernel"}
    assert _kernels_run(lambda: gemm(rows[3], w)) == {"gemv_rows_kernel"}
    for m in (2, 5):  # no bucket of their own: cuBLAS, exactly F.linear
        assert _kernels_run(lambda: gemm(rows[m], w)) == set()
        torch.testing.assert_close(gemm(rows[m], w), torch.nn.functional.linear(rows[m], w), rtol=0, atol=0)


@needs_cuda
def test_tune_decides_per_shape_and_rows_once_and_skips_large_weights(tiny_model_dir):
    from minisgl.layers import gemv
    from minisgl.layers.linear import CpuGemm
    from minisgl.models.loader import load_model

    model, _ = load_model(tiny_model_dir("qwen3"), dtype=torch.bfloat16, device="cuda")
    tuned = gemv.tune(model)
    gemms = [m for m in model.modules() if isinstance(getattr(m, "gemm", None), CpuGemm)]
    assert tuned == sum(bool(m.gemm.gemv) for m in gemms)
    assert all(set(m.gemm.gemv) <= {1, 2, 4} for m in gemms)
    by_shape: dict[tuple[int, ...], set] = {}
    for m in gemms:
        by_shape.setdefault(tuple(m.weight.shape), set()).add(frozenset(m.gemm.gemv.items()))
    assert all(len(choices) == 1 for choices in by_shape.values())  # one decision per weight shape
