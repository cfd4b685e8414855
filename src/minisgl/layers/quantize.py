"""--quantization fp8 on a built model: which weights are rounded to FP8 (layers/fp8.py holds the format)."""

from __future__ import annotations

from torch import nn

from minisgl.layers.fp8 import round_through_fp8
from minisgl.layers.linear import LinearBase
from minisgl.layers.moe import FusedMoE


def quantize_model_fp8(model: nn.Module) -> int:
    """--quantization fp8: every linear of the decoder layers (and the experts) rounded to FP8 with per-channel
    scales, computed back in the model's dtype; the embedding, the LM head and MoE routers stay as they are
    (what vLLM and SGLang leave unquantized). How many weights were rounded."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, FusedMoE)}
    routers |= {id(m.shared_expert_gate) for m in model.modules() if isinstance(m, FusedMoE)}
    rounded = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and id(module) not in routers:
            round_through_fp8(module.weight)
            rounded += 1
        elif isinstance(module, FusedMoE):
            round_through_fp8(module.gate_up_proj)
            round_through_fp8(module.down_proj)
            rounded += 2
    return rounded
