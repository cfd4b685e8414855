"""--quantization fp8 and FP8 checkpoints on a built model: which weights are FP8 (layers/fp8.py holds the format).

On a GPU with FP8 GEMMs (layers/fp8_gemm.py: compute capability 9.0+, bf16 models) the weights become e4m3 with
per-channel scales and the GEMMs read them as such (`to_fp8_gemms`): half the weight bytes in memory and per decode
step. Elsewhere (the CPU, older GPUs) they are rounded to FP8 and computed back in the model's dtype
(`quantize_model_fp8`): FP8's accuracy, not its memory or speed. Either way the same weights are FP8: every linear
of the decoder layers and the experts; the embedding, the LM head and MoE routers stay as they are (what vLLM and
SGLang leave unquantized).

`check_quantization` and `quantize_model` are the engine's policy: which --quantization a device and dtype take,
and what each does to the loaded weights (the CPU's fp16/int8 GEMMs of layers/linear.py, or FP8 as above).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from minisgl.config import CPU_QUANTIZATIONS
from minisgl.errors import ConfigError
from minisgl.layers.fp8 import checkpoint_quantization, round_through_fp8
from minisgl.layers.fp8_gemm import FP8, Fp8Gemm, quantize_per_channel, supported
from minisgl.layers.linear import LinearBase, quantize_gemms
from minisgl.layers.moe import FusedMoE
from minisgl.layers.norm import RMSNorm

logger = logging.getLogger("minisgl")


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """A CPU quantization (fp16, int8) asked for on another device or dtype is a ConfigError."""
    if quantization in CPU_QUANTIZATIONS and (device.type != "cpu" or dtype != torch.float32):
        raise ConfigError(
            f"quantization={quantization!r} is a CPU float32 mode (device {device}, dtype "
            f"{str(dtype).removeprefix('torch.')}): use device='cpu' without a dtype, or drop quantization"
        )


def quantize_model(
    model: nn.Module, quantization: str | None, hf_config: Any, device: torch.device, dtype: torch.dtype
) -> None:
    """`quantization` applied to the loaded weights: fp16/int8 CPU GEMMs, or FP8 (GEMMs in FP8 on a GPU
    that has them, for quantization='fp8' and FP8 checkpoints alike; else rounding in the model's dtype)."""
    fp8_checkpoint = checkpoint_quantization(hf_config) is not None
    if (quantization == "fp8" or fp8_checkpoint) and supported(device, dtype):
        # A block-wise checkpoint was dequantized at load: its weights are re-quantized here per channel.
        converted = to_fp8_gemms(model)
        logger.info("fp8: %d weights in e4m3 with per-channel scales, FP8 GEMMs", converted)
    elif quantization == "fp8":
        if fp8_checkpoint:
            logger.info("fp8: the checkpoint's weights are FP8 already; not rounded again")
            return
        rounded = quantize_model_fp8(model)
        logger.info("fp8: %d weights rounded to FP8 per channel, computed in %s", rounded, dtype)
    elif quantization is not None:
        quantize_gemms(model, quantization)


def _fp8_weights(model: nn.Module) -> Iterator[LinearBase | FusedMoE]:
    """The modules whose weights are FP8: the decoder's linears (routers excepted) and the routed experts."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    routers = {id(m.gate) for m in moes} | {id(m.shared_expert_gate) for m in moes}
    for module in model.modules():
        if (isinstance(module, LinearBase) and id(module) not in routers) or isinstance(module, FusedMoE):
            yield module


def quantize_model_fp8(model: nn.Module) -> int:
    """Every FP8 weight rounded to FP8 with per-channel scales, in place in the model's dtype; how many weights."""
    rounded = 0
    for module in _fp8_weights(model):
        weights = [module.gate_up_proj, module.down_proj] if isinstance(module, FusedMoE) else [module.weight]
        for weight in weights:
            round_through_fp8(weight)
        rounded += len(weights)
    return rounded


def _to_fp8(weight: torch.Tensor) -> tuple[nn.Parameter, torch.Tensor]:
    """(e4m3 parameter, float32 per-channel scales) of a weight [..., N, K], one leading index at a time (a stack
    of experts never needs a float32 copy of the whole stack)."""
    if weight.dim() == 2:
        q, scale = quantize_per_channel(weight)
        return nn.Parameter(q, requires_grad=False), scale
    q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[:-1], dtype=torch.float32, device=weight.device)
    for i in range(weight.shape[0]):
        q[i], scale[i] = quantize_per_channel(weight[i])
    return nn.Parameter(q, requires_grad=False), scale


def to_fp8_gemms(model: nn.Module) -> int:
    """Every FP8 weight replaced by e4m3 + per-channel scales, its GEMM by the FP8 one (CUDA, after the load);
    how many weights. The bf16 copies are freed one by one, so the peak is the bf16 model plus one weight."""
    converted = 0
    for module in _fp8_weights(model):
        if isinstance(module, FusedMoE):
            module.gate_up_proj, gate_up_scale = _to_fp8(module.gate_up_proj)
            module.down_proj, down_scale = _to_fp8(module.down_proj)
            module.fp8_scales = (gate_up_scale, down_scale)
            converted += 2
        else:
            module.weight, scale = _to_fp8(module.weight)
            module.gemm = Fp8Gemm(scale)
            converted += 1
    for module in model.modules():  # their kernels let the FP8 GEMMs after them launch at once (Fp8Gemm's PDL)
        if isinstance(module, RMSNorm):
            module.early_dependents = True
    _pair_norms(model)
    torch.cuda.empty_cache()
    return converted


def _pair_norms(model: nn.Module) -> None:
    """Each decoder layer's norms quantize their outputs for the FP8 GEMM they feed (the QKV projection, a dense
    MLP's gate_up): that GEMM needs no quantization kernel of its own above the weight-only rows."""
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for norm, linear in (
            (getattr(layer, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
            (getattr(layer, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None)),
        ):
            if isinstance(norm, RMSNorm) and isinstance(getattr(linear, "gemm", None), Fp8Gemm):
                norm.quantizes_for = linear.gemm


def is_fp8_on_gpu(model: nn.Module) -> bool:
    """Whether to_fp8_gemms converted this model (its weights can no longer be loaded in place)."""
    return any(isinstance(getattr(m, "gemm", None), Fp8Gemm) for m in model.modules())
