"""ModelConfig: the few numbers of a HF config that the runtime needs, read once, frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _as_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _DTYPES.get(value.removeprefix("torch."), torch.float32)
    return torch.float32  # unspecified: the checkpoint's own precision is unknown, fp32 is safe


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling or None) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0)
    if "type" in params and "rope_type" not in params:  # legacy spelling
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype  # the checkpoint's dtype (load_model replaces it by the dtype it runs in)
    # Mixture of experts (0 experts: a dense model): each of moe_layers routes a token to num_experts_per_tok of
    # num_experts SiLU-gated MLPs of width moe_intermediate_size; the other layers keep the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert of this width, sigmoid-gated per token
    hf_config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None, architecture: str | None = None) -> "ModelConfig":
        """Read a transformers PretrainedConfig (architecture: the name to run it as, else its first one)."""
        arch = architecture or architecture_of(hf_config)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        num_heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        rope_theta, rope_scaling = _rope(text)
        eos = _int_tuple(getattr(text, "eos_token_id", None))
        if generation_config is not None:
            eos += tuple(t for t in _int_tuple(getattr(generation_config, "eos_token_id", None)) if t not in eos)
        return cls(
            architecture=arch,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_layers=int(text.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and its config has no flag for it.
            attention_bias=arch.startswith("Qwen2") or bool(getattr(text, "attention_bias", False)),
            qk_norm=arch.startswith("Qwen3"),
            hidden_act=str(getattr(text, "hidden_act", "silu")),
            eos_token_ids=eos,
            dtype=_as_dtype(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)),
            **_moe_fields(text),
            hf_config=hf_config,
        )


def architecture_of(hf_config: Any) -> str:
    """The first of a transformers config's ``architectures`` ("" if it names none)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return archs[0] if archs else ""


def _moe_fields(text: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE / Qwen2-MoE or Mixtral config; none for a dense one."""
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    if experts == 0:
        return {}
    layers = int(text.num_hidden_layers)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    # Mixtral: every layer sparse, experts as wide as intermediate_size, weights always renormalised.
    mixtral = getattr(text, "moe_intermediate_size", None) is None
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(text.num_experts_per_tok),
        moe_intermediate_size=int(text.intermediate_size if mixtral else text.moe_intermediate_size),
        norm_topk_prob=True if mixtral else bool(getattr(text, "norm_topk_prob", False)),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=int(getattr(text, "shared_expert_intermediate_size", None) or 0),
    )
