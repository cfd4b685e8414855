"""Rotary position embedding (neox / HF Llama style), with llama3 and linear frequency scaling.

cos/sin are precomputed in float32 for every position up to max_position and indexed by the
flat `positions` of the batch, so mixed prefill/decode batches need no per-request work.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minisgl.errors import ModelLoadError
from minisgl.layers.fused import FLASHINFER_HEAD_DIMS, fused_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Same formula as transformers' _compute_llama3_parameters.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
    raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._fused = head_dim in FLASHINFER_HEAD_DIMS  # flashinfer's kernel takes this size
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        # Non-persistent: derived from the config, never in a checkpoint.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self._cos_sin: torch.Tensor | None = None  # [max_position, head_dim] float32, flashinfer's layout
        # rotate_cpu's [cos, cos] and [-sin, sin] per position (built on first use), and those of the last positions.
        self._cos_sin_full: tuple[torch.Tensor, torch.Tensor] | None = None
        self._positions: torch.Tensor | None = None
        self._selected: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def cos_sin(self) -> torch.Tensor:
        """[max_position, head_dim] float32: cos of each frequency, then sin (flashinfer's layout)."""
        if self._cos_sin is None or self._cos_sin.device != self.cos_cache.device:
            self._cos_sin = torch.cat([self.cos_cache, self.sin_cache], dim=-1).contiguous()
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k [T, kv_heads, head_dim] rotated at positions [T].

        On CUDA (flashinfer, for the head sizes it is built for) q and k are rotated in place in one kernel.
        """
        fi = fused_ops(q) if self._fused else None
        if fi is not None:
            fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, self.head_dim, self.cos_sin(), is_neox=True)
            return q, k
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_cpu(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (q and k side by side) rotated at positions [T], for float32 CPU tensors: HF's
        x * cos + rotate_half(x) * sin in four ops, the same bits. Every layer of a forward passes the same positions
        tensor: its cos/sin rows are selected once per forward."""
        # The engine builds a new positions tensor for each batch (an inference tensor: no version counter to check).
        if positions is not self._positions:
            if self._cos_sin_full is None:
                cos, sin = self.cos_cache, self.sin_cache
                self._cos_sin_full = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
            cos, sin = self._cos_sin_full
            self._selected = cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)
            self._positions = positions
        cos, sin = self._selected
        # rotate_half(x) * sin == roll(x) * [-sin, sin]: negating x2 or sin gives the same products.
        return x * cos + x.roll(self.head_dim // 2, -1) * sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF casts cos/sin to the activation dtype before the products; do the same for equal numerics.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
