"""Llama-family decoder: Llama, Mistral (dense), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm); the
mixture-of-experts members (models/moe.py) swap the MLP of their sparse layers for layers/moe.py's FusedMoE.

Protocol the engine relies on:
  forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]
      T is the flat token count of every request in the batch; attention goes through
      minisgl.core.get_context().attn_backend for the batch set by Context.forward_batch.
  compute_logits(hidden [N, hidden_size]) -> [N, vocab_size] float32
  load_weights(iterable of (HF name, tensor)); raises WeightsError on missing or unknown names.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from minisgl.errors import ModelLoadError, WeightsError
from minisgl.layers import (
    AttentionLayer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from minisgl.layers.context import get_context
from minisgl.layers.fused_qkv import fused_qkv
from minisgl.layers.gemv import fused_norm_linear
from minisgl.layers.moe import FusedMoE
from minisgl.models.config import ModelConfig

# HF checkpoint name fragment -> (our fused parameter fragment, shard id).
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, bias=config.attention_bias
        )
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.attn = AttentionLayer(self.num_heads, self.num_kv_heads, self.head_dim, layer_id, self.head_dim**-0.5)

    def qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, out_loc: torch.Tensor, q_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(q, k, v) of the QKV projection's output qkv [T, q_size + 2 kv_size], normed and rotated; k = v = None when
        they were stored at out_loc already (CUDA: norms, RoPE and the KV store in one kernel, q written into q_out if
        given)."""
        pool = self.attn.pool_for_fused_store(qkv)
        if pool is not None:
            qn, kn = self.q_norm, self.k_norm
            q = fused_qkv(
                qkv,
                positions,
                self.rotary.cos_sin(),
                qn.weight if qn else None,
                kn.weight if kn else None,
                qn.eps if qn else 0.0,
                pool.k(self.attn.layer_id),
                pool.v(self.attn.layer_id),
                out_loc,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                out=q_out,
            )
            return q, None, None
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.q_norm is None and qkv.device.type == "cpu" and qkv.dtype == torch.float32:
            # q and k side by side in qkv: one rotation of both, v a view (the fewest ops for CPU decode).
            heads = self.num_heads + self.num_kv_heads
            qk = self.rotary.rotate_cpu(positions, qkv.narrow(-1, 0, q_size + kv_size).view(-1, heads, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return q, k, qkv.narrow(-1, q_size + kv_size, kv_size).view(-1, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=False)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        fused = getattr(self.gate_up_proj.gemm, "gate_up_silu", None)  # FP8 GEMMs: SiLU-and-mul in the epilogue
        act = fused(x, self.gate_up_proj.weight) if fused is not None else None
        if act is None:
            act = self.act(self.gate_up_proj(x))
        return self.down(act, reduce)

    def down(self, act: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The down projection of the activated gate_up output act."""
        return self.down_proj(act, reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.mlp: nn.Module
        if layer_id in config.moe_layers:
            self.mlp = FusedMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.attention_input(positions, hidden, residual, get_context().batch.out_loc)
        return self.attention_output(self.self_attn.attn(q, k, v), residual)

    # The layer in two halves around attention (the eager forward above, and engine/piecewise.py's CUDA
    # graphs, which capture everything but attention). The residual add of each sub-block is fused into
    # the next norm, and so is the tensor-parallel all-reduce of its output: o_proj and the MLP hand on their
    # partial sums (reduce=False) and the next norm's reduce_forward reduces them (between layers, a layer's
    # hidden output is those partial sums; the first layer's, the embedding, is complete).
    def attention_input(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        out_loc: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(q, k, v, residual): the input norm (residual None: hidden is the embedding, and the residual)."""
        fused = fused_norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        if fused is not None:  # one row: the norm inside the QKV projection's GEMV
            qkv, residual = fused
        elif residual is None:
            residual = hidden
            qkv = self.self_attn.qkv_proj(self.input_layernorm(hidden))
        else:
            hidden, residual = self.input_layernorm.reduce_forward(hidden, residual)
            qkv = self.self_attn.qkv_proj(hidden)
        return (*self.self_attn.qkv(positions, qkv, out_loc, q_out), residual)

    def attention_output(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the output projection, the post-attention norm and the MLP; hidden is the MLP's
        partial sums under tensor parallelism (the next norm's reduce_forward reduces them)."""
        partial = self.self_attn.o_proj(attn_out, reduce=False)
        if isinstance(self.mlp, LlamaMLP):
            fused = fused_norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, partial, residual, True)
            if fused is not None:  # one row: the norm, the gate_up GEMV and SiLU-and-mul in one kernel
                act, residual = fused
                return self.mlp.down(act, reduce=False), residual
        hidden, residual = self.post_attention_layernorm.reduce_forward(partial, residual)
        return self.mlp(hidden, reduce=False), residual

    def gemv_norm_pairs(self) -> list[tuple[nn.Module, nn.Module, bool]]:
        """The (norm, linear, gated) pairs that layers/gemv.py may run as one kernel at one row."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj, False)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj, True))
        return pairs


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache shared by every layer.
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm.reduce_forward(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def parameter_for(self, hf_name: str) -> tuple[str, int | str | tuple[int, int] | None]:
        """(our parameter's name, shard id) of a checkpoint tensor: fused q/k/v and gate/up take a shard each."""
        for hf_part, our_part, sid in _STACKED:
            if hf_part in hf_name:
                return hf_name.replace(hf_part, our_part), sid
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | str | tuple[int, int] | None]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # derived from the config
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the same tensor as embed_tokens
            name, shard_id = self.parameter_for(hf_name)
            param = params.get(name)
            if param is None:
                raise WeightsError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of {self.config.architecture}; "
                    "is config.json's architecture right for these weights?"
                )
            try:
                with torch.no_grad():
                    param.weight_loader(param, tensor, shard_id)
            except WeightsError as e:
                raise WeightsError(f"{hf_name}: {e}") from None
            loaded.add((name, shard_id))
        expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise WeightsError(f"{len(missing)} parameters missing from the checkpoint: {shown}")
