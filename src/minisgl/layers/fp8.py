"""FP8 (e4m3) weights: the checkpoint's block-quantized form, quantizing at load, and the dequantizing fallback.

A weight W [N, K] is held as Q (float8_e4m3fn, the same shape) and scale_inv [ceil(N / bn), ceil(K / bk)] float32
with W ~= Q * scale_inv over each bn x bk block (edge blocks cut short): the block-wise format of DeepSeek-V3 and
Qwen3-FP8 checkpoints (quant_method "fp8", weight_block_size [128, 128], tensors `<name>.weight_scale_inv`).
Per-channel scales are the block (1, K), a per-tensor scale the block (N, K).

Tensor-parallel shards slice Q and its scales together (Fp8Weight.narrow, called by the layers' weight loaders as
they narrow a plain tensor), so a rank's shard must start on a block boundary. copy_checked dequantizes each shard at
load into the model's dtype; on a GPU with FP8 GEMMs layers/quantize.py then makes the weights FP8 again with one
scale per output channel (layers/fp8_gemm.py's format), which its kernels read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from minisgl.errors import ConfigError, WeightsError

logger = logging.getLogger(__name__)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The checkpoint quantizations load_model reads (quantization_config in config.json), for error messages.
SUPPORTED = (
    'FP8 ones: quant_method "fp8" (block-wise weight_scale_inv, or weight_scale per tensor or channel) or '
    '"compressed-tensors" with FP8 weights and channel or tensor scales'
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N / bn), ceil(K / bk)] repeated over its blocks to [N, K]."""
    rows = scale.repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


@dataclass(frozen=True)
class Fp8Weight:
    """A 2-D FP8 weight with one float32 scale per block: weight ~= qweight * scale_inv (block-expanded)."""

    qweight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        want = tuple(_ceil_div(n, b) for n, b in zip(self.qweight.shape, self.block))
        if self.qweight.dim() != 2 or tuple(self.scale_inv.shape) != want:
            raise WeightsError(
                f"FP8 weight {tuple(self.qweight.shape)} with blocks {self.block} needs scales of shape {want}, "
                f"got {tuple(self.scale_inv.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """The rows (dim 0) or columns (dim 1) [start, start + length) with their blocks' scales."""
        size, full = self.block[dim], self.qweight.shape[dim]
        if start % size or (length % size and start + length != full):
            what = "output rows" if dim == 0 else "input columns"
            raise ConfigError(
                f"a tensor-parallel shard of {what} [{start}, {start + length}) of an FP8 weight "
                f"{tuple(self.qweight.shape)} cuts its {self.block[0]}x{self.block[1]} scale blocks: each rank's "
                f"slice must be whole {size}-wide blocks; use a smaller tp (or an unquantized checkpoint)"
            )
        return Fp8Weight(
            self.qweight.narrow(dim, start, length),
            self.scale_inv.narrow(dim, start // size, _ceil_div(length, size)),
            self.block,
        )

    def dequantize(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """The weight in dtype, computed on device (a GPU receives the FP8 bytes, half those of bf16)."""
        scale = _expand(self.scale_inv.to(device, torch.float32), self.qweight.shape, self.block)
        return (self.qweight.to(device).float() * scale).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """Round a 2-D weight to e4m3 with one scale (max |w| / 448) per block; edge blocks cut short."""
    w = weight.detach().float()
    n, k = w.shape
    bn, bk = block
    padded = torch.zeros(_ceil_div(n, bn) * bn, _ceil_div(k, bk) * bk, device=w.device)
    padded[:n, :k] = w.abs()
    amax = padded.view(padded.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3))
    scale_inv = amax.clamp(min=1e-12) / FP8_MAX  # an all-zero block keeps a tiny scale, its weights stay 0
    q = (w / _expand(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale_inv, block)


def round_through_fp8(weight: torch.Tensor) -> None:
    """Replace each row of a weight (any leading dims) by its per-channel FP8 rounding, in place."""
    rows = weight.reshape(-1, weight.shape[-1])
    with torch.no_grad():
        weight.copy_(quantize(rows, (1, rows.shape[1])).dequantize(weight.dtype, weight.device).view_as(weight))


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """A checkpoint's FP8 `quantization_config` (quant_method "fp8", or compressed-tensors with FP8 weights)."""

    weight_block_size: tuple[int, int] | None  # None: per-tensor or per-channel `weight_scale` tensors
    activation_scheme: str  # "dynamic" or "static" (activation scales unused while weights are dequantized)


def checkpoint_quantization(hf_config: Any) -> Fp8CheckpointConfig | None:
    """The FP8 quantization a checkpoint's config.json declares; None for an unquantized one. ConfigError for a
    method minisgl cannot load."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(qc)
    if method != "fp8":
        raise ConfigError(
            f"checkpoint quantization {method or qc!r} is not supported: minisgl loads unquantized checkpoints and "
            f"{SUPPORTED}; use the unquantized model, optionally with quantization='fp8'"
        )
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return Fp8CheckpointConfig(
        weight_block_size=(int(block[0]), int(block[1])) if block else None,
        activation_scheme=str(qc.get("activation_scheme", "dynamic")),
    )


def _compressed_tensors_fp8(qc: dict[str, Any]) -> Fp8CheckpointConfig:
    """llm-compressor's format when every group holds FP8 weights with per-channel or per-tensor `weight_scale`."""
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (
            w.get("type") != "float"
            or int(w.get("num_bits") or 0) != 8
            or w.get("strategy") not in ("channel", "tensor")
        ):
            raise ConfigError(
                f"compressed-tensors group {name!r} ({w.get('type')} {w.get('num_bits')}-bit weights, strategy "
                f"{w.get('strategy')!r}) is not supported: minisgl loads unquantized checkpoints and {SUPPORTED}"
            )
    if not groups:
        raise ConfigError(f"a compressed-tensors quantization_config without config_groups: minisgl loads {SUPPORTED}")
    static = any((g.get("input_activations") or {}).get("dynamic") is False for g in groups.values())
    return Fp8CheckpointConfig(weight_block_size=None, activation_scheme="static" if static else "dynamic")


def _scale_block(scale: torch.Tensor, shape: torch.Size, suffix: str, config: Fp8CheckpointConfig) -> tuple[int, int]:
    if suffix == "_scale_inv":
        if config.weight_block_size is None:
            raise WeightsError("weight_scale_inv tensors need quantization_config.weight_block_size in config.json")
        return config.weight_block_size
    if scale.numel() == 1:
        return (shape[0], shape[1])  # per tensor
    if scale.numel() == shape[0]:
        return (1, shape[1])  # per output channel
    raise WeightsError(f"weight_scale of shape {tuple(scale.shape)} fits neither per tensor nor per channel")


def with_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: Fp8CheckpointConfig | None
) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """The checkpoint's tensors with every FP8 weight paired with its scales into one Fp8Weight (in any order of
    the files); the rest as they are. WeightsError for an FP8 weight without scales or scales without a weight."""
    weights_of: dict[str, torch.Tensor] = {}
    scales_of: dict[str, tuple[torch.Tensor, str]] = {}
    skipped = 0
    for name, tensor in weights:
        if config is None:  # an unquantized checkpoint: only FP8 data would be wrong here
            if tensor.dtype in FP8_WEIGHT_DTYPES:
                raise WeightsError(f"{name} is FP8 data but config.json has no quantization_config (quant_method fp8)")
            yield name, tensor
            continue
        if name.endswith(".input_scale"):
            skipped += 1  # static activation scales: activations stay in the model's dtype
            continue
        suffix = next((s for s in ("_scale_inv", "_scale") if name.endswith(".weight" + s)), None)
        if suffix is None and tensor.dtype not in FP8_WEIGHT_DTYPES:
            yield name, tensor
            continue
        base = name.removesuffix(suffix) if suffix else name
        if suffix:
            scales_of[base] = (tensor, suffix)
        else:
            weights_of[base] = tensor
        if base in weights_of and base in scales_of:
            qweight, (scale, kind) = weights_of.pop(base), scales_of.pop(base)
            block = _scale_block(scale, qweight.shape, kind, config)
            want = tuple(_ceil_div(n, b) for n, b in zip(qweight.shape, block))
            yield (
                base,
                Fp8Weight(qweight, scale.float() if kind == "_scale_inv" else scale.float().reshape(want), block),
            )
    if weights_of or scales_of:
        names = sorted(weights_of) + sorted(f"{n}{s}" for n, (_, s) in scales_of.items())
        raise WeightsError(f"FP8 weights without scales or scales without weights: {', '.join(names[:5])}")
    if skipped:
        logger.info("%d activation scales (input_scale) unused: activations are not quantized here", skipped)
