"""The Llama-family model over the paged KV pool (torch-native attention) against HF transformers logits."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.models import load_model

FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_model_dir):
    """(minisgl model, its config, HF reference model) for one tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir(request.param)
    model, config = load_model(model_dir, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model, config, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_prefill_logits_match_hf_at_every_position(family, paged_runner, page_size):
    model, config, hf = family
    runner = paged_runner(model, config, page_size=page_size)
    prompts = [random_tokens(n, config.vocab_size, seed=n) for n in (5, 37, 18)]
    got = runner.step(rows=[2, 0, 1], seqs=prompts, prefix_lens=[0, 0, 0])
    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_then_extend_then_decode_match_hf_on_the_full_sequence(family, paged_runner, page_size):
    model, config, hf = family
    runner = paged_runner(model, config, page_size=page_size)
    full = [random_tokens(n, config.vocab_size, seed=100 + n) for n in (40, 23)]
    ref = [hf_logits(hf, seq) for seq in full]
    rows = [3, 1]
    # 1. A chunk of each prompt (different lengths, one shorter than a page).
    chunk = [17, 9]
    got = runner.step(rows, [s[:c] for s, c in zip(full, chunk)], [0, 0])
    for r, g, c in zip(ref, got, chunk):
        torch.testing.assert_close(g, r[:c], atol=ATOL, rtol=1e-4)
    # 2. The rest of the prompts on top of the cached chunks, minus the last 3 tokens.
    prompt = [len(s) - 3 for s in full]
    got = runner.step(rows, [s[:p] for s, p in zip(full, prompt)], chunk)
    for r, g, c, p in zip(ref, got, chunk, prompt):
        torch.testing.assert_close(g, r[c:p], atol=ATOL, rtol=1e-4)
    # 3. Single-token decode steps for both requests at once.
    for step in range(3):
        seq_lens = [p + step + 1 for p in prompt]
        got = runner.step(rows, [s[:n] for s, n in zip(full, seq_lens)], [n - 1 for n in seq_lens])
        for r, g, n in zip(ref, got, seq_lens):
            assert g.shape[0] == 1
            torch.testing.assert_close(g[0], r[n - 1], atol=ATOL, rtol=1e-4)


def test_mixed_batch_of_decode_and_long_extend_matches_hf(family, paged_runner):
    """One request decodes while another extends many tokens in the same pass (padded queries stay finite)."""
    model, config, hf = family
    runner = paged_runner(model, config, page_size=16)
    a, b = random_tokens(30, config.vocab_size, 7), random_tokens(26, config.vocab_size, 8)
    runner.step([0, 1], [a[:29], b[:4]], [0, 0])
    got = runner.step([0, 1], [a, b], [29, 4])
    assert all(torch.isfinite(g).all() for g in got)
    torch.testing.assert_close(got[0], hf_logits(hf, a)[29:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got[1], hf_logits(hf, b)[4:], atol=ATOL, rtol=1e-4)


def test_model_config_reads_family_specifics(tiny_model_dir):
    from transformers import AutoConfig

    from minisgl.models import ModelConfig

    qwen2 = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("qwen2")))
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    qwen3 = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("qwen3")))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32
    llama3 = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("llama3")))
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling["rope_type"] == "llama3"
    llama = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir("llama")))
    assert llama.rope_scaling is None and llama.num_kv_heads == 2 and llama.head_dim == 32
    assert llama.eos_token_ids == (2,) and llama.dtype == torch.float32


def test_tp_shards_have_per_rank_shapes():
    """Layers built for rank 1 of tp=2 hold half the heads and the right slice of the checkpoint."""
    from minisgl.distributed import set_tp_info
    from minisgl.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    full_qkv = [torch.randn(4 * 8, 16), torch.randn(1 * 8, 16), torch.randn(1 * 8, 16)]
    set_tp_info(1, 2)
    try:
        qkv = QKVParallelLinear(16, 8, total_num_heads=4, total_num_kv_heads=1)  # kv head replicated
        gate_up = MergedColumnParallelLinear(16, [12, 12])
        down = RowParallelLinear(12, 16)
    finally:
        set_tp_info(0, 1)
    assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1) and qkv.weight.shape == (4 * 8, 16)
    for shard_id, w in zip("qkv", full_qkv):
        qkv.weight.weight_loader(qkv.weight, w, shard_id)
    assert torch.equal(qkv.weight[:16], full_qkv[0][16:32])
    assert torch.equal(qkv.weight[16:24], full_qkv[1]) and torch.equal(qkv.weight[24:], full_qkv[2])
    gate, up = torch.randn(12, 16), torch.randn(12, 16)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    assert torch.equal(gate_up.weight, torch.cat([gate[6:], up[6:]]))
    w = torch.randn(16, 12)
    down.weight.weight_loader(down.weight, w)
    assert torch.equal(down.weight, w[:, 6:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_gemm_packs_exactly_the_dtypes_this_cpu_can_pack(dtype):
    """CpuGemm's capability table agrees with oneDNN itself: packing raises exactly for the dtypes it marks
    unpackable."""
    from minisgl.layers.linear import CpuGemm

    if not CpuGemm.enabled:
        pytest.skip("this torch build has no oneDNN linear")
    w = torch.randn(16, 8, dtype=dtype)
    try:
        torch.ops.mkldnn._reorder_linear_weight(w, 32)
        oneDNN_packs = True
    except RuntimeError:
        oneDNN_packs = False
    if dtype == torch.float16:  # never packed (not measured); F.linear always
        assert CpuGemm.packs(dtype) is False
    else:
        assert CpuGemm.packs(dtype) is oneDNN_packs


@pytest.mark.parametrize("path", ["packed", "fallback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_gemm_follows_every_change_of_the_weight(dtype, path, monkeypatch):
    """Both paths (a packed oneDNN copy of the weight, F.linear) equal an fp32 F.linear, also after loads and
    in-place edits.
    The fallback is forced through the capability table, so it runs on every CPU; the packed path
    runs where this CPU can pack the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT).
    """
    from minisgl.layers import MergedColumnParallelLinear
    from minisgl.layers.linear import CpuGemm

    if path == "packed" and not CpuGemm.packs(dtype):
        pytest.skip(f"this CPU ({torch.backends.cpu.get_cpu_capability()}) cannot pack {dtype} for oneDNN")
    if path == "fallback":
        monkeypatch.setitem(CpuGemm.packable, dtype, False)
    layer = MergedColumnParallelLinear(64, [48, 48], bias=True).to(dtype)
    gate, up = torch.randn(48, 64), torch.randn(48, 64)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.bias.weight_loader(layer.bias, torch.randn(48), 0)
    layer.bias.weight_loader(layer.bias, torch.randn(48), 1)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}

    def check(rows: int) -> None:
        x = torch.randn(rows, 64, dtype=dtype)
        expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(layer(x).float(), expected, **tol)

    for rows in (1, 7, 32, 200):
        check(rows)
    # Which path ran: only the packed one keeps a packed copy of the weight.
    assert (layer.gemm._packed is not None) == (path == "packed")
    layer.weight.weight_loader(layer.weight, -gate, 0)  # a re-load (the HF patch's weight re-sync)
    check(5)
    with torch.no_grad():
        layer.weight.mul_(3)  # an in-place edit of the live parameter
    check(5)
    layer.weight = torch.nn.Parameter(torch.randn(96, 64, dtype=dtype), requires_grad=False)  # a new tensor
    check(5)


def test_bf16_model_matches_hf_on_every_cpu(tiny_model_dir, paged_runner):
    """A bf16 model runs whatever the CPU supports (packed or F.linear) and matches HF's fp32 logits to bf16
    precision."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("llama")
    model, config = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = random_tokens(19, config.vocab_size, seed=3)
    got = paged_runner(model, config).step(rows=[0], seqs=[prompt], prefix_lens=[0])[0]
    ref = hf_logits(hf, prompt)
    assert ref.abs().max() > 1  # the tolerance below is small next to the logits
    torch.testing.assert_close(got.float(), ref, atol=1e-1, rtol=5e-2)
