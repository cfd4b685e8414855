"""The attention backend interface: exactly the verbs the engine and the attention layer call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool


class AttentionBackend(ABC):
    """Owns its per-batch metadata (batch.attn_metadata), built once by prepare()."""

    @abstractmethod
    def prepare(self, batch: "Batch") -> None:
        """Build batch.attn_metadata from the batch and the page table (once per forward)."""

    def kv_pool_for(self, batch: "Batch") -> "KVPool | None":
        """The pool forward() attends from, when a layer may store k, v there itself and pass None."""
        return None

    @abstractmethod
    def forward(
        self,
        q: "torch.Tensor",
        k: "torch.Tensor",
        v: "torch.Tensor",
        layer_id: int,
        batch: "Batch",
        out: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        """Store k, v ([T, kv_heads, head_dim]) at batch.out_loc, then attend.

        k = v = None (only where kv_pool_for(batch) is a pool): the layer stored them already.

        q is [T, num_heads, head_dim]; returns [T, num_heads * head_dim]. Each request attends
        causally to its prefix_len cached tokens plus its own extend tokens. out ([T, num_heads *
        head_dim], optional): the result is written there and out is returned (a CUDA graph's
        static buffer, without a copy where the kernel can write it itself).
        """
