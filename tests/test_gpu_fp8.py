"""FP8 weights on the GPU (layers/fp8_gemm.py): the kernels against a float32 reference, FP8 models against HF
transformers' bf16 model on the same trained checkpoint (dense and MoE), CUDA graphs on and off on random ones.
Skipped without CUDA + flashinfer or without FP8 GEMMs (compute capability 9.0+); tools/device/gpu_fp8_check.sh
runs them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import test_gpu
from test_gpu import (  # noqa: F401
    COPY_HI,
    COPY_LO,
    LAG,
    MAX_NEW,
    copier_config,
    copier_dir,
    generate,
    make_prompts,
    parity,
    periodic,
    qwen3_dir,
    report,
    teacher_forced,
    train_copier,
)
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


@pytest.fixture(scope="module")
def moe_copier_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The copier task learnt by a Qwen3-MoE (8 experts, top-2) of the copier's shape."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **copier_config(moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    )
    return train_copier(config, tmp_path_factory.mktemp("moe-copier"), "moe_copier_train_accuracy_fp32")


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_fp8_on_a_trained_model_agrees_with_its_bf16_model(which, copier_dir, moe_copier_dir):  # noqa: F811
    """Greedy outputs with FP8 weights (inputs quantized per row in the prefill's GEMMs), teacher-forced by HF's
    unquantized bf16 model: top-1 >= 98% at clear-margin positions, and the outputs still continue the cycle.

    A trained model, because on random weights FP8 itself moves the argmax: the weights' rounding alone, computed
    exactly in float32, keeps ~82% of a random Qwen3's clear-margin top-1 (its top two logits are ~0.1 apart, the
    rounding's noise ~0.03); a trained model's predictions stand well clear of it, as a real model's do."""
    from transformers import AutoModelForCausalLM

    from minisgl import SamplingParams

    model_dir = copier_dir if which == "dense" else moe_copier_dir
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(20, 200, (16,), generator=g).tolist()
    bases = torch.randint(COPY_LO, COPY_HI, (16, LAG), generator=g)
    prompts = [periodic(b[None], n)[0].tolist() for b, n in zip(bases, lengths)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ours, info = generate(model_dir, prompts, params, quantization="fp8")
    assert info["graphs"] and info["overlap"]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    metrics = parity(teacher_forced(hf, prompts, ours), ours)
    del hf
    expected = [periodic(b[None], n + MAX_NEW)[0, n:].tolist() for b, n in zip(bases, lengths)]
    task = sum(o == e for o, e in zip(ours, expected))
    report(f"fp8_trained_{which}_vs_hf_bf16", {**metrics, "continuing_the_cycle": f"{task}/16"})
    assert metrics["top1_clear_margin"] >= 0.98, metrics
    assert task >= 12


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
