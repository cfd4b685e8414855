"""FP8 weights on the GPU (layers/fp8_gemm.py): the kernels against a float32 reference, and FP8 models against HF
transformers' bf16 model on the same checkpoint, dense and MoE, with CUDA graphs on and off (skipped without CUDA +
flashinfer, and without FP8 GEMMs: compute capability 9.0+; run by tools/device/gpu_check.sh's tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import test_gpu
from test_gpu import MAX_NEW, generate, make_prompts, parity, qwen3_dir, report, teacher_forced  # noqa: F401
from test_gpu_moe import moe_dir  # noqa: F401

pytestmark = [
    *test_gpu.pytestmark,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="FP8 GEMMs need compute capability 9.0+",
    ),
]


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() @ (q.float() * scale[:, None]).t()


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 65, 300])
@pytest.mark.parametrize("k,n", [(1024, 3072), (3072, 1024), (4096, 6144)])
def test_fp8_linear_matches_the_dequantized_product(rows, k, n):
    """Both kernels against x @ W^T in float32 on the dequantized weight: the weight-only kernel (up to
    weight_only_rows) differs by bf16 accumulation order only; above it x is rounded to e4m3 too."""
    from minisgl.layers.fp8_gemm import fp8_linear, quantize_per_channel, weight_only_rows

    torch.manual_seed(rows + k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_per_channel(torch.randn(n, k, device="cuda") * 0.02)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x, q, scale, bias)
    ref = _reference(x, q, scale) + bias.float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert err < (0.01 if rows <= weight_only_rows() else 0.06), err  # x in e4m3: ~2^-4 / sqrt(3) rms
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, q, scale, bias, out=out)
    assert torch.equal(out, y)


def test_fp8_experts_match_the_dequantized_loop():
    """The fused MoE kernel with FP8 experts against layers/moe.py's plain loop on the dequantized experts."""
    from minisgl.layers.fp8_gemm import quantize_per_channel
    from minisgl.layers.fused_moe import fused_moe
    from minisgl.layers.moe import experts_loop, route

    torch.manual_seed(0)
    experts, hidden, inter = 16, 512, 256
    gate_up, s1 = quantize_per_channel(torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.05)
    down, s2 = quantize_per_channel(torch.randn(experts, hidden, inter, device="cuda") * 0.05)
    for tokens in (1, 9, 256):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        y = fused_moe(x, logits, gate_up, down, 4, True, (s1, s2))
        weights, ids = route(logits, 4, True)
        ref = experts_loop(x.float(), weights, ids, gate_up.float() * s1[..., None], down.float() * s2[..., None])
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 0.02, (tokens, err)


def _hf_bf16(model_dir: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()


def _fp8_against_bf16(model_dir: Any, key: str) -> None:
    """Greedy FP8 outputs scored by HF's bf16 model teacher-forced: top-1 >= 98% where its margin is clear."""
    from minisgl import SamplingParams

    prompts = make_prompts()
    ours, info = generate(
        model_dir, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), quantization="fp8"
    )
    assert info["graphs"] and info["overlap"]
    hf = _hf_bf16(model_dir)
    metrics = parity(teacher_forced(hf, prompts, ours), ours)
    rerun = parity(teacher_forced(hf, prompts, info["rerun"]), info["rerun"])
    del hf
    report(key, {"first": metrics, "cached_rerun": rerun})
    assert metrics["top1_clear_margin"] >= 0.98, metrics
    assert rerun["top1_clear_margin"] >= 0.98, rerun


def test_fp8_dense_agrees_with_the_bf16_model(qwen3_dir):  # noqa: F811
    _fp8_against_bf16(qwen3_dir, "fp8_dense_vs_hf_bf16")


def test_fp8_moe_agrees_with_the_bf16_model(moe_dir):  # noqa: F811
    _fp8_against_bf16(moe_dir, f"fp8_moe_vs_hf_bf16_{moe_dir.name}")


def _graphs_on_and_off(model_dir: Any, key: str) -> None:
    from minisgl import SamplingParams

    prompts = make_prompts(24, seed=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    results = {}
    for graphs in (True, False):
        tokens, info = generate(model_dir, prompts, params, disable_cuda_graph=not graphs, quantization="fp8")
        assert info["graphs"] == graphs
        results[graphs] = tokens
    same = sum(a == b for a, b in zip(results[True], results[False]))
    report(key, f"{same}/{len(prompts)}")
    assert results[True] == results[False]


def test_fp8_dense_identical_with_and_without_cuda_graphs(qwen3_dir):  # noqa: F811
    _graphs_on_and_off(qwen3_dir, "fp8_identical_graphs_vs_eager_dense")


def test_fp8_moe_identical_with_and_without_cuda_graphs(moe_dir):  # noqa: F811
    _graphs_on_and_off(moe_dir, f"fp8_identical_graphs_vs_eager_{moe_dir.name}")
