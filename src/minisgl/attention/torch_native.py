"""Attention in plain PyTorch: runs on any device; the CPU default and the reference for other backends.

Every request of the batch is padded to [max_extend] queries and [max_seq] keys so that one
scaled_dot_product_attention call covers the whole batch (prefill with a cached prefix,
chunked prefill, decode, or a mix of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool
    from minisgl.models.config import ModelConfig


class TorchNativeMetadata(NamedTuple):
    kv_indices: torch.Tensor  # [bs * max_seq] KV slots of every (request, key position), padding -> a valid slot
    mask: torch.Tensor  # [bs, 1, max_extend, max_seq] bool, True = attend
    token_to_padded: torch.Tensor  # [T] index of each flat token in the padded [bs * max_extend] queries
    dense: bool  # every request extends by max_extend (e.g. decode): flat tokens are already the padded layout
    bs: int
    max_extend: int
    max_seq: int


class TorchNativeBackend(AttentionBackend):
    def __init__(
        self, model_config: "ModelConfig", kv_pool: "KVPool", page_table: torch.Tensor, device: torch.device | str
    ) -> None:
        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, max_seq_len] int64 slots, owned by the scheduler
        self.device = torch.device(device)
        self.scale = model_config.head_dim**-0.5

    def prepare(self, batch: "Batch") -> None:
        bs = batch.size
        max_extend, max_seq = max(batch.extend_lens), max(batch.seq_lens)
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        seq = torch.tensor(batch.seq_lens, dtype=torch.int64)
        q_pos = torch.arange(max_extend)
        k_pos = torch.arange(max_seq)

        # Padded query rows copy the limit of the request's last real query, so no row is all-masked (no NaN).
        q_clamped = torch.minimum(q_pos[None, :], (extend - 1)[:, None])
        visible = prefix[:, None] + q_clamped + 1  # [bs, max_extend] keys each query may see
        mask = k_pos[None, None, :] < visible[:, :, None]

        is_token = q_pos[None, :] < extend[:, None]
        token_to_padded = torch.arange(bs * max_extend)[is_token.flatten()]

        rows = batch.table_rows.to(self.page_table.device)
        slots = self.page_table.index_select(0, rows)[:, :max_seq]
        in_seq = (k_pos[None, :] < seq[:, None]).to(slots.device)
        # Slots past a request's length are unset in the table; point them at a real one (masked anyway).
        kv_indices = torch.where(in_seq, slots, slots[:, :1]).flatten()

        batch.attn_metadata = TorchNativeMetadata(
            kv_indices=kv_indices.to(self.device, non_blocking=True),
            mask=mask.unsqueeze(1).to(self.device, non_blocking=True),
            token_to_padded=token_to_padded.to(self.device, non_blocking=True),
            dense=token_to_padded.numel() == bs * max_extend,
            bs=bs,
            max_extend=max_extend,
            max_seq=max_seq,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: "Batch"
    ) -> torch.Tensor:
        self.kv_pool.store(layer_id, batch.out_loc, k, v)
        md: TorchNativeMetadata = batch.attn_metadata
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]

        keys = self.kv_pool.k(layer_id).index_select(0, md.kv_indices).to(q.dtype)
        values = self.kv_pool.v(layer_id).index_select(0, md.kv_indices).to(q.dtype)
        keys = keys.view(md.bs, md.max_seq, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(md.bs, md.max_seq, num_kv_heads, head_dim).transpose(1, 2)

        if md.dense:
            padded_q = q
        else:
            padded_q = q.new_zeros(md.bs * md.max_extend, num_heads, head_dim)
            padded_q.index_copy_(0, md.token_to_padded, q)
        padded_q = padded_q.reshape(md.bs, md.max_extend, num_heads, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            padded_q, keys, values, attn_mask=md.mask, scale=self.scale, enable_gqa=num_heads != num_kv_heads
        )
        out = out.transpose(1, 2).reshape(md.bs * md.max_extend, num_heads * head_dim)
        return out if md.dense else out.index_select(0, md.token_to_padded)
