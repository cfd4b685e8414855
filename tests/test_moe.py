"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) on the CPU against HF transformers: config, logits, greedy
generation with the radix cache and chunked prefill, and the experts' tensor-parallel shards."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM
from minisgl.models import load_model
from test_llm import GREEDY, assert_parity, hf_greedy, make_prompts

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


def test_model_config_reads_the_experts_and_the_sparse_layers(tiny_model_dir):
    from transformers import AutoConfig

    from minisgl.models import ModelConfig

    qwen = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("qwen3_moe")))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    assert qwen.moe_layers == (0, 2) and not qwen.norm_topk_prob and qwen.qk_norm  # layer 1 is in mlp_only_layers
    mixtral = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("mixtral")))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 32)
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and not mixtral.qk_norm
    qwen2 = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("qwen2_moe")))
    assert qwen2.moe_layers == (1, 3) and qwen2.shared_expert_intermediate_size == 48 and qwen2.attention_bias
    dense = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("qwen3")))
    assert dense.num_experts == 0 and dense.moe_layers == ()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logits_match_hf(tiny_model_dir, paged_runner, family):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(family)
    model, config = load_model(model_dir, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(10, config.vocab_size, (37,), generator=gen).tolist(), [5, 6, 7, 8, 9, 10]
    runner = paged_runner(model, config)
    got = runner.step([0, 1], [a[:30], b], [0, 0])  # a batched prefill
    got += runner.step([0], [a[:31]], [30])  # one decode token on top of the cached prefix
    with torch.inference_mode():
        ref_a, ref_b = (hf(torch.tensor([t])).logits[0] for t in (a[:31], b))
    torch.testing.assert_close(got[0], ref_a[:30], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], ref_a[30:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(page_size=1), dict(page_size=16, max_prefill_tokens=16)],  # chunked: smaller than the prompts
    ids=["p1", "p16-chunked"],
)
def test_greedy_generate_matches_hf_also_from_the_radix_cache(tiny_model_dir, family, engine_kwargs):
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(1000)
    ref = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    llm = LLM(str(model_dir), device="cpu", **engine_kwargs)  # float32 on any machine: exact greedy parity
    first = assert_parity(llm, prompts, ref)
    second = assert_parity(llm, prompts, ref)  # now served from the prefix cache
    assert (
        sum(o.cached_tokens for o in first) > 0 and sum(o.cached_tokens for o in second) > sum(map(len, prompts)) // 2
    )


def test_expert_shards_hold_this_ranks_slice_of_every_expert():
    """Rank 1 of tp=2 holds the second half of each expert's intermediate dimension: gate, up and down."""
    from minisgl.distributed import set_tp_info
    from minisgl.errors import WeightsError
    from minisgl.layers.moe import FusedMoE

    set_tp_info(1, 2)
    try:
        moe = FusedMoE(hidden_size=16, intermediate_size=12, num_experts=3, top_k=2, renormalize=True)
    finally:
        set_tp_info(0, 1)
    assert moe.gate_up_proj.shape == (3, 12, 16) and moe.down_proj.shape == (3, 16, 6)
    gate, up, down = torch.randn(12, 16), torch.randn(12, 16), torch.randn(16, 12)
    moe.gate_up_proj.weight_loader(moe.gate_up_proj, gate, (2, 0))
    moe.gate_up_proj.weight_loader(moe.gate_up_proj, up, (2, 1))
    moe.down_proj.weight_loader(moe.down_proj, down, (2, 2))
    assert torch.equal(moe.gate_up_proj[2], torch.cat([gate[6:], up[6:]]))
    assert torch.equal(moe.down_proj[2], down[:, 6:])
    with pytest.raises(WeightsError, match="expert"):
        moe.down_proj.weight_loader(moe.down_proj, down, (3, 2))


def _moe_of_rank(rank: int, size: int, expert_parallel: bool, **kw: int) -> torch.nn.Module:
    from minisgl.distributed import set_tp_info
    from minisgl.layers.moe import FusedMoE

    set_tp_info(rank, size, "ep" if expert_parallel else "tp")
    try:
        return FusedMoE(renormalize=True, **kw)
    finally:
        set_tp_info(0, 1)


def test_expert_parallel_shards_hold_whole_experts_of_this_ranks_range():
    """Rank 1 of tp=2 with expert parallelism holds experts 2 and 3 of 4, whole; the others' tensors are skipped."""
    from minisgl.errors import WeightsError

    moe = _moe_of_rank(1, 2, True, hidden_size=16, intermediate_size=12, num_experts=4, top_k=2)
    assert moe.gate_up_proj.shape == (2, 24, 16) and moe.down_proj.shape == (2, 16, 12)
    assert moe.gate_up_proj.shard_ids == tuple((e, j) for e in range(4) for j in (0, 1))  # every expert checked
    moe.gate_up_proj.data.zero_()
    moe.down_proj.data.zero_()
    gate, up, down = torch.randn(12, 16), torch.randn(12, 16), torch.randn(16, 12)
    for expert in (1, 3):  # expert 1 is rank 0's
        moe.gate_up_proj.weight_loader(moe.gate_up_proj, gate, (expert, 0))
        moe.gate_up_proj.weight_loader(moe.gate_up_proj, up, (expert, 1))
        moe.down_proj.weight_loader(moe.down_proj, down, (expert, 2))
    assert torch.equal(moe.gate_up_proj[1], torch.cat([gate, up])) and torch.equal(moe.down_proj[1], down)
    assert not moe.gate_up_proj[0].any() and not moe.down_proj[0].any()
    with pytest.raises(WeightsError, match="expert"):
        moe.down_proj.weight_loader(moe.down_proj, down, (4, 2))


@pytest.mark.parametrize("shared", [0, 8], ids=["routed", "with-shared-expert"])
def test_expert_parallel_ranks_partial_sums_add_up_to_the_whole_layer(shared):
    """Each rank of tp=2 computes its own experts' part (and its half of a shared expert) for every token in
    float32; the two parts add up to the unsplit layer's output."""
    sizes = dict(hidden_size=16, intermediate_size=12, num_experts=6, top_k=3, shared_intermediate_size=shared)
    whole = _moe_of_rank(0, 1, False, **sizes)
    ranks = [_moe_of_rank(r, 2, True, **sizes) for r in (0, 1)]
    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(p.shape, generator=g) for name, p in whole.named_parameters()}
    whole.load_state_dict(state)
    for rank, moe in enumerate(ranks):
        mine = slice(3 * rank, 3 * rank + 3)
        for name, p in moe.named_parameters():
            if name in ("gate_up_proj", "down_proj"):
                p.data.copy_(state[name][mine])
            elif name == "shared_expert.down_proj.weight":  # the shared expert stays split across the ranks
                p.data.copy_(state[name].chunk(2, dim=1)[rank])
            elif name == "shared_expert.gate_up_proj.weight":  # this rank's half of the gate rows, then of the up rows
                p.data.copy_(torch.cat([half.chunk(2)[rank] for half in state[name].chunk(2)]))
            else:
                p.data.copy_(state[name])
    x = torch.randn(23, 16, generator=g)
    with torch.no_grad():
        want = whole(x)
        parts = [moe(x, reduce=False) for moe in ranks]
    assert all(part.abs().sum() > 0 for part in parts)
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_needs_the_experts_divisible_by_the_ranks():
    from minisgl.errors import ConfigError

    with pytest.raises(ConfigError, match="use a tp that divides 6, or moe_parallel='tp'"):
        _moe_of_rank(0, 4, True, hidden_size=16, intermediate_size=12, num_experts=6, top_k=2)
    _moe_of_rank(0, 4, False, hidden_size=16, intermediate_size=12, num_experts=6, top_k=2)  # "tp" splits I


def test_moe_parallel_takes_auto_tp_or_ep(monkeypatch):
    from minisgl.config import EngineConfig
    from minisgl.errors import ConfigError

    monkeypatch.delenv("MINISGL_MOE_PARALLEL", raising=False)
    assert EngineConfig().moe_parallel == "auto"
    monkeypatch.setenv("MINISGL_MOE_PARALLEL", "ep")
    assert EngineConfig().moe_parallel == "ep"
    with pytest.raises(ConfigError, match="moe_parallel must be one of auto, tp, ep"):
        EngineConfig(moe_parallel="dp")
    monkeypatch.setenv("MINISGL_MOE_PARALLEL", "dp")
    with pytest.raises(ConfigError, match="MINISGL_MOE_PARALLEL must be one of auto, tp, ep"):
        EngineConfig()
