"""`--attention-backend PREFILL,DECODE`: one backend for prefill/extend batches, another for decode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.attention.base import AttentionBackend

if TYPE_CHECKING:
    import torch

    from minisgl.core import Batch


class HybridBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        # CUDA graphs only ever replay decode batches.
        self.supports_cuda_graph = getattr(decode, "supports_cuda_graph", False)

    def _pick(self, batch: "Batch") -> AttentionBackend:
        return self.decode if batch.is_decode else self.prefill

    def prepare(self, batch: "Batch") -> None:
        self._pick(batch).prepare(batch)

    def kv_pool_for(self, batch: "Batch") -> Any:
        return self._pick(batch).kv_pool_for(batch)

    def forward(
        self,
        q: "torch.Tensor",
        k: "torch.Tensor",
        v: "torch.Tensor",
        layer_id: int,
        batch: "Batch",
        out: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        return self._pick(batch).forward(q, k, v, layer_id, batch, out=out)

    def __getattr__(self, name: str) -> Any:
        # Decode CUDA-graph verbs (init_cuda_graph, capture_metadata, prepare_replay) belong to the decode side, the
        # one-request prefill graphs' (engine/piecewise.py) to the prefill side.
        if name in ("init_cuda_graph", "capture_metadata", "prepare_replay"):
            return getattr(self.__dict__["decode"], name)
        if name in ("init_prefill_graphs", "capture_prefill_metadata", "prepare_prefill_replay"):
            return getattr(self.__dict__["prefill"], name)
        raise AttributeError(name)
