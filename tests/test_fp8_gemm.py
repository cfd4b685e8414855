"""The FP8 GEMM kernels of layers/fp8_gemm.py and the FP8 experts of layers/fused_moe.py against float32 references.

On a CUDA machine with FP8 (compute capability 9.0+) they run compiled on e4m3 weights (tests/test_gpu_fp8.py also
runs whole models); on any machine with Triton the kernels' indexing and scaling run in Triton's interpreter
(TRITON_INTERPRET=1, numpy on the CPU) in a fresh process, with float32 stand-ins for the e4m3 tensors (numpy has no
FP8): the kernels widen whatever they load to the input's dtype, so only the rounding differs.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import interpreter_or_cuda, run_interpreter_cases


def test_the_kernels_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=15, timeout=600)


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    interpreter_or_cuda(request.param)
    if request.param == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 GEMMs need compute capability 9.0+")
    return request.param


def _weights(n: int, k: int, device: str, lead: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, per-channel scale): e4m3 on CUDA (quantized), a float32 stand-in with random scales in the
    interpreter."""
    from minisgl.layers.fp8_gemm import quantize_per_channel

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(*lead, n, k, generator=g) * 0.05
    if device == "cuda":
        return quantize_per_channel(w.cuda())
    return w, torch.rand(*lead, n, generator=g) + 0.5


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 96, 80), (3, 1100, 40), (5, 256, 200), (33, 130, 64)])
def test_weight_only_kernels_match_float32(device, rows, k, n):
    """weight_only (CUDA cores for one row, tensor cores above) against x @ W^T in float32."""
    from minisgl.layers.fp8_gemm import weight_only

    q, scale = _weights(n, k, device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    got = weight_only(x, q, scale)
    ref = x.float() @ (q.float() * scale[:, None]).t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("rows", "k", "inter"), [(1, 300, 40), (5, 160, 72)])
def test_gate_up_epilogue_applies_silu_and_mul(device, rows, k, inter):
    """weight_only(gate_up=True) on an MLP's [2I, K] gate_up weight: silu(gate) * up, as the GEMM followed by
    SiLU-and-mul computes it (gate and up rounded to x's dtype first)."""
    from minisgl.layers.fp8_gemm import weight_only

    q, scale = _weights(2 * inter, k, device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    got = weight_only(x, q, scale, gate_up=True)
    gate, up = (x.float() @ (q.float() * scale[:, None]).t()).to(dtype).float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("rows", "k", "n", "gate_up"),
    [(3, 256, 80, False), (40, 300, 200, False), (70, 256, 96, True), (64, 12288, 64, False)],
)
def test_w8a8_kernel_matches_float32(device, rows, k, n, gate_up):
    """w8a8 (decode batches: x quantized per row, FP8 x FP8 on the tensor cores) against (q_x * s_x) @ (q_w * s_w)^T
    in float32; gate_up: silu(gate) * up of the two halves, each rounded to the output dtype first. The 12,288-long
    rows (Qwen3-8B's down projection) check that the FP8 MMA's partial sums reach the float32 accumulator."""
    from minisgl.layers.fp8_gemm import quantize_rows, w8a8

    q, scale = _weights(n, k, device)
    g = torch.Generator().manual_seed(rows)
    if device == "cuda":
        qx, sx = quantize_rows(torch.randn(rows, k, generator=g).to(device, torch.bfloat16))
        dtype = torch.bfloat16
    else:
        qx, sx, dtype = torch.randn(rows, k, generator=g), torch.rand(rows, 1, generator=g) + 0.5, torch.float32
    got = w8a8(qx, sx, q, scale, dtype, gate_up=gate_up)
    ref = (qx.float() * sx) @ (q.float() * scale[:, None]).t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if gate_up:
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    assert got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 96), (5, 200)])
def test_add_rmsnorm_matches_the_fused_add_norm(device, tokens, hidden):
    """add_rmsnorm (the norm before an FP8 GEMM): residual += x, x = RMSNorm(residual) * w, the norm taken from the
    float32 sum before it is rounded, as flashinfer's fused_add_rmsnorm computes it."""
    from minisgl.layers.fp8_gemm import add_rmsnorm

    g = torch.Generator().manual_seed(tokens)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, res = (torch.randn(tokens, hidden, generator=g).to(device, dtype) for _ in range(2))
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    total = x.float() + res.float()
    want = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    add_rmsnorm(x, res, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(res.float(), total.to(dtype).float(), atol=0, rtol=0)
    torch.testing.assert_close(x.float(), want, atol=tol, rtol=tol)


def test_the_norm_hands_its_row_quantization_to_the_gemm_it_feeds(device):
    """Above the weight-only rows add_rmsnorm(quantize_for=gemm) also quantizes its output per row, exactly as
    quantize_rows would, and hands it over: that GEMM's next call on the same tensor skips its own quantization."""
    from minisgl.layers.fp8_gemm import Fp8Gemm, add_rmsnorm, quantize_rows

    if device == "cpu":
        pytest.skip("numpy has no e4m3: the row quantization runs on CUDA only")
    x, res = torch.randn(40, 256, device=device, dtype=torch.bfloat16), torch.randn(40, 256, device=device).bfloat16()
    gemm = Fp8Gemm(torch.ones(8, device=device))
    add_rmsnorm(x, res, torch.ones(256, device=device, dtype=torch.bfloat16), 1e-6, quantize_for=gemm)
    q, scale = gemm._take(x)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
    assert gemm._take(x) is None  # used once


def test_a_handed_over_quantization_serves_only_its_own_tensor():
    """Fp8Gemm takes a norm's quantization only for the tensor it was made from, once; any call clears it."""
    from minisgl.layers.fp8_gemm import Fp8Gemm

    gemm = Fp8Gemm(torch.ones(4))
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    q, scale = torch.zeros(3, 8), torch.ones(3, 1)
    gemm.hand_over(x, q, scale)
    assert gemm._take(other) is None and gemm._take(x) is None  # the miss cleared it
    gemm.hand_over(x, q, scale)
    assert gemm._take(x[:2]) is None  # same storage, another shape
    gemm.hand_over(x, q, scale)
    got = gemm._take(x)
    assert got is not None and got[0] is q and got[1] is scale


@pytest.mark.parametrize(
    ("tokens", "first", "local"), [(3, 0, 6), (40, 0, 6), (40, 2, 3)], ids=["3", "40", "40-experts-2-to-5-of-6"]
)
def test_scaled_experts_match_the_loop(device, tokens, first, local):
    """fused_moe with per-channel expert scales against the loop over the scaled (dequantized) experts; a rank
    holding experts [first, first + local) only (expert parallelism) against the loop over all experts with the
    others' down projections zeroed."""
    from minisgl.layers.fused_moe import fused_moe
    from minisgl.layers.moe import experts_loop, route

    experts, hidden, inter, top_k = 6, 64, 48, 2
    gate_up, s1 = _weights(2 * inter, hidden, device, (experts,))
    down, s2 = _weights(hidden, inter, device, (experts,))
    g = torch.Generator().manual_seed(tokens)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=g).to(device)
    mine = slice(first, first + local)
    got = fused_moe(x, logits, gate_up[mine], down[mine], top_k, True, (s1[mine], s2[mine]), expert_offset=first)
    weights, ids = route(logits, top_k, True)
    kept = torch.zeros(experts, 1, 1, device=device)
    kept[mine] = 1.0
    ref = experts_loop(x.float(), weights, ids, gate_up.float() * s1[..., None], down.float() * s2[..., None] * kept)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_row_quantization_bounds_each_row(device):
    """quantize_rows: x ~= q * scale per row, max |q| = 448 on each row; an all-zero row stays zero."""
    from minisgl.layers.fp8_gemm import FP8_MAX, quantize_rows

    if device == "cpu":
        pytest.skip("numpy has no e4m3: the row quantization runs on CUDA only")
    x = torch.randn(9, 3000, device=device, dtype=torch.bfloat16) * torch.arange(9, device=device)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (9, 1)
    assert torch.equal(q[0].float(), torch.zeros(3000, device=device))
    torch.testing.assert_close(q[1:].float().abs().amax(dim=1), torch.full((8,), FP8_MAX, device=device))
    torch.testing.assert_close(q.float() * scale, x.float(), atol=0.1 * x.float().abs().max().item() / 16, rtol=0.07)
