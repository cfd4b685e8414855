"""The forward context: what a model's attention layers need during a forward (the batch, the backend, the pool).

The engine fills it once (backend, pool) and per forward (the batch); the attention layer reads it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool


@dataclass
class Context:
    """What a model's attention layers need during a forward: the batch, the backend, the pool."""

    attn_backend: "AttentionBackend | None" = None
    kv_pool: "KVPool | None" = None
    batch: "Batch | None" = None

    @contextmanager
    def forward_batch(self, batch: "Batch") -> Iterator["Batch"]:
        assert self.batch is None, "forward passes do not nest"
        self.batch = batch
        try:
            yield batch
        finally:
            self.batch = None


_GLOBAL_CTX = Context()


def get_context() -> Context:
    return _GLOBAL_CTX
