"""The attention layer: hands q, k, v to whichever backend runs the current forward pass."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import get_context


class AttentionLayer(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        ctx = get_context()
        assert ctx.attn_backend is not None and ctx.batch is not None, "run the model inside Context.forward_batch"
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
