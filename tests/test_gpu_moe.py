"""Mixture-of-experts models on the GPU (bf16, the fused Triton MoE path) against HF transformers in float32,
and with CUDA graphs on and off (skipped without CUDA + flashinfer; run by tools/device/gpu_check.sh's tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import test_gpu
from test_gpu import MAX_NEW, VOCAB, generate, make_prompts, parity, report, teacher_forced, tokenizer_dir

pytestmark = test_gpu.pytestmark


def _config(family: str, tok: Any) -> Any:
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    if family == "qwen3_moe":  # 32 experts, top-4 renormalised, layer 1 dense
        return Qwen3MoeConfig(
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            **common,
        )
    return MixtralConfig(
        intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, sliding_window=None, **common
    )


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF's random init, with routers 10x wider: a trained router's choices are clear, HF init's are near-ties that
    any bf16 rounding flips (and a flipped expert changes the token's whole MLP output)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path_factory.mktemp(f"{request.param}-gpu")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param, tok))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):
                param.mul_(10)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id).save_pretrained(out)
    return out


def test_moe_bf16_teacher_forced_top1_matches_hf_fp32(moe_dir):
    from transformers import AutoModelForCausalLM

    from minisgl import SamplingParams

    prompts = make_prompts()
    ours, info = generate(moe_dir, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert info["graphs"] and info["overlap"]
    hf = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).cuda().eval()
    metrics = parity(teacher_forced(hf, prompts, ours), ours)
    rerun = parity(teacher_forced(hf, prompts, info["rerun"]), info["rerun"])
    report(f"moe_parity_vs_hf_fp32_{moe_dir.name}", {"first": metrics, "cached_rerun": rerun})
    assert metrics["top1_clear_margin"] >= 0.99, metrics
    assert rerun["top1_clear_margin"] >= 0.99, rerun


def test_moe_greedy_tokens_identical_with_and_without_cuda_graphs(moe_dir):
    from minisgl import SamplingParams

    prompts = make_prompts(24, seed=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    results = {}
    for graphs in (True, False):
        tokens, info = generate(moe_dir, prompts, params, disable_cuda_graph=not graphs)
        assert info["graphs"] == graphs
        results[graphs] = tokens
    same = sum(a == b for a, b in zip(results[True], results[False]))
    report(f"moe_identical_graphs_vs_eager_{moe_dir.name}", f"{same}/{len(prompts)}")
    assert results[True] == results[False]
