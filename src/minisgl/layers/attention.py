"""The attention layer: hands q, k, v to whichever backend runs the current forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.layers.context import get_context
from minisgl.layers.fused_qkv import stores_into as fused_qkv_stores_into
from minisgl.layers.fused_qkv import usable as fused_qkv_usable

if TYPE_CHECKING:
    from minisgl.kvcache.pool import KVPool


class AttentionLayer(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads  # per rank
        self.num_kv_heads = num_kv_heads  # per rank
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.scale = scale

    def pool_for_fused_store(self, qkv: torch.Tensor) -> "KVPool | None":
        """The KV pool the model may store this layer's k, v into itself (then forward(q, None, None)).

        None unless layers.fused_qkv can run on qkv and store into the pool the current backend attends from.
        """
        if not fused_qkv_usable(qkv, self.head_dim):
            return None
        ctx = get_context()
        assert ctx.attn_backend is not None and ctx.batch is not None, "run the model inside Context.forward_batch"
        pool = ctx.attn_backend.kv_pool_for(ctx.batch)
        if pool is not None and pool.is_fp8:  # an fp8 pool: only where Triton converts to its dtype
            if not fused_qkv_stores_into(pool.dtype, torch.cuda.get_device_capability(qkv.device)):
                return None
        return pool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim] (written into out if given).

        k = v = None: they are already in the KV pool at the batch's out_loc (pool_for_fused_store).
        """
        ctx = get_context()
        assert ctx.attn_backend is not None and ctx.batch is not None, "run the model inside Context.forward_batch"
        if out is None:
            return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch, out=out)
