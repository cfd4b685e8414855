"""Attention in plain PyTorch: runs on any device; the CPU default and the reference for other backends.

Every request of the batch is padded to [max_extend] queries and [max_seq] keys so that one
scaled_dot_product_attention call covers the whole batch (prefill with a cached prefix,
chunked prefill, decode, or a mix of them).

On the CPU, decode keeps a dense copy of the batch's keys and values (DecodeMirror): while the
decode batch stays the same requests in the same order, each step appends one token per request
to it instead of gathering every request's whole history from the paged pool again (a
memory-bound copy that was 15% of a decode step). Any other batch rebuilds it with the gather.
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


MIRROR_MAX_BYTES = 1 << 30  # the largest dense decode copy kept (all layers, keys and values)
MIRROR_HEADROOM = 64  # positions allocated past the longest request, so appends rarely reallocate
SERIAL_DECODE_KEYS = 32768  # decode attention over at most this many (request, kv head, key) runs on one thread


class DecodeMirror:
    """Dense [layers, 2, rows >= bs, kv_heads, capacity, head_dim] keys/values of the last decode batch.

    plan() picks the mode of a forward; the copy counts as up to date only once the forward's last
    layer has run (commit), so a forward that fails half-way leads to a rebuild, never to a stale read.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.layer_rows: torch.Tensor | None = None  # buffer as [layers, 2 * rows * kv_heads * capacity, head_dim]
        self.rows: list[int] | None = None  # page-table rows of the requests it holds, in batch order
        self.seq_lens: list[int] = []
        self._pending: tuple[list[int], list[int]] | None = None

    def plan(self, batch: "Batch", shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> str | None:
        """'append' (one more token per request than the copy holds), 'full' (rebuild from the pool) or None."""
        num_layers, kv_heads, head_dim = shape
        rows = [r.table_idx for r in batch.reqs]
        seq_lens = list(batch.seq_lens)
        self._pending = (rows, seq_lens)
        if (
            self.buffer is not None
            and rows == self.rows
            and self.buffer.shape[4] >= max(seq_lens)
            and all(s == p + 1 for s, p in zip(seq_lens, self.seq_lens))
        ):
            return "append"
        self.rows, self.seq_lens = None, []  # the rebuild overwrites what the copy held
        capacity = max(seq_lens) + MIRROR_HEADROOM
        nbytes = num_layers * 2 * len(rows) * capacity * kv_heads * head_dim * dtype.itemsize
        if nbytes > MIRROR_MAX_BYTES:
            self.invalidate()
            return None
        # A smaller batch (requests finished) reuses the copy's first rows: no new allocation.
        if self.buffer is None or self.buffer.shape[2] < len(rows) or self.buffer.shape[4] < max(seq_lens):
            self.buffer = None  # free the old copy before allocating the new one
            # Zeros: positions past a request's length are masked, but must not hold NaN (0 * NaN).
            self.buffer = torch.zeros(
                num_layers, 2, len(rows), kv_heads, capacity, head_dim, dtype=dtype, device=device
            )
            self.layer_rows = self.buffer.view(num_layers, -1, head_dim)
        return "full"

    def views(self, bs: int, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a forward's bs requests, [layers, bs, kv_heads, max_seq, head_dim] each."""
        held = self.buffer[:, :, :bs, :, :max_seq]  # type: ignore[index]
        return held[:, 0], held[:, 1]

    def commit(self) -> None:
        if self._pending is not None:
            self.rows, self.seq_lens = self._pending
            self._pending = None

    def invalidate(self) -> None:
        self.buffer, self.layer_rows, self.rows, self.seq_lens, self._pending = None, None, None, [], None


class TorchNativeMetadata(NamedTuple):
    kv_indices: torch.Tensor  # [bs * max_seq] KV slots of every (request, key position), padding -> a valid slot
    mask: torch.Tensor  # [bs, 1, max_extend, max_seq] bool, True = attend
    token_to_padded: torch.Tensor  # [T] index of each flat token in the padded [bs * max_extend] queries
    dense: bool  # every request extends by max_extend (e.g. decode): flat tokens are already the padded layout
    bs: int
    max_extend: int
    max_seq: int
    mirror: str | None = None  # decode on the CPU: "append" to the dense copy, or "full" (rebuild it)
    # ("append") rows of the layer's copy viewed as [2 * rows * kv_heads * capacity, head_dim] that the new keys
    # ([bs * kv_heads], request-major) and values (the second half) go to.
    append_rows: torch.Tensor | None = None
    mirror_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # (mirror) DecodeMirror.views of this forward


class TorchNativeBackend(AttentionBackend):
    def __init__(
        self, model_config: "ModelConfig", kv_pool: "KVPool", page_table: torch.Tensor, device: torch.device | str
    ) -> None:
        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, max_seq_len] int64 slots, owned by the scheduler
        self.device = torch.device(device)
        self.scale = model_config.head_dim**-0.5
        self.mirror = DecodeMirror()
        self._head_ids = torch.arange(kv_pool.k(0).shape[1])[None, :]  # [1, kv heads]
        self.num_layers = model_config.num_layers

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
        mask: torch.Tensor | None = k_pos[None, None, :] < visible[:, :, None]

        is_token = q_pos[None, :] < extend[:, None]
        token_to_padded = torch.arange(bs * max_extend)[is_token.flatten()]

        mirror = None
        if self.device.type == "cpu" and max_extend == 1:
            k_pool = self.kv_pool.k(0)
            shape = (self.num_layers, k_pool.shape[1], k_pool.shape[2])
            mirror = self.mirror.plan(batch, shape, self.kv_pool.read_dtype, self.device)
        else:
            self.mirror.invalidate()

        if self.device.type == "cpu":
            # Additive once here rather than converted from bool by every layer's SDPA; none where nothing is
            # masked (a decode batch of equal lengths, one request always): adding zeros changes no bit.
            if bool(mask.all()):
                mask = None
            else:
                mask = torch.zeros(mask.shape, dtype=self.kv_pool.model_dtype).masked_fill_(~mask, float("-inf"))

        append_rows = None
        if mirror == "append":
            kv_indices = torch.empty(0, dtype=torch.int64)  # the dense copy has every key but the new ones
            append_rows = self._append_rows(seq - 1)
        else:
            rows = batch.table_rows.to(self.page_table.device)
            slots = self.page_table.index_select(0, rows)[:, :max_seq]
            in_seq = (k_pos[None, :] < seq[:, None]).to(slots.device)
            # Slots past a request's length are unset in the table; point them at a real one (masked anyway).
            kv_indices = torch.where(in_seq, slots, slots[:, :1]).flatten()
        batch.attn_metadata = TorchNativeMetadata(
            kv_indices=kv_indices.to(self.device, non_blocking=True),
            mask=None if mask is None else mask.unsqueeze(1).to(self.device, non_blocking=True),
            token_to_padded=token_to_padded.to(self.device, non_blocking=True),
            dense=token_to_padded.numel() == bs * max_extend,
            bs=bs,
            max_extend=max_extend,
            max_seq=max_seq,
            mirror=mirror,
            append_rows=append_rows,
            mirror_kv=None if mirror is None else self.mirror.views(bs, max_seq),
        )

    def _append_rows(self, last: torch.Tensor) -> torch.Tensor:
        """TorchNativeMetadata.append_rows for the new tokens at positions last [bs] of the copy's first bs rows."""
        _, _, rows, kv_heads, capacity, _ = self.mirror.buffer.shape  # type: ignore[union-attr]
        bs = last.shape[0]
        request_head = torch.arange(bs)[:, None] * kv_heads + self._head_ids  # [bs, kv heads]
        keys = (request_head * capacity + last[:, None]).flatten()
        return torch.cat([keys, keys + rows * kv_heads * capacity])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: "Batch",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = self._attend(q, k, v, layer_id, batch)
        return result if out is None else out.copy_(result)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: "Batch") -> torch.Tensor:
        self.kv_pool.store(layer_id, batch.out_loc, k, v)
        md: TorchNativeMetadata = batch.attn_metadata
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]

        if md.mirror != "append":
            keys, values = (
                self.kv_pool.gather(layer_id, which, md.kv_indices)
                .view(md.bs, md.max_seq, num_kv_heads, head_dim)
                .transpose(1, 2)
                for which in (0, 1)
            )
        if md.mirror is not None:
            dense_keys, dense_values = md.mirror_kv  # type: ignore[misc]
            if md.mirror == "append":  # the pool's new entries, as a gather would read them
                new = torch.cat([self.kv_pool.as_read(k), self.kv_pool.as_read(v)]).view(-1, head_dim)
                self.mirror.layer_rows[layer_id].index_copy_(0, md.append_rows, new)  # type: ignore[index]
            else:
                dense_keys[layer_id].copy_(keys)
                dense_values[layer_id].copy_(values)
            keys, values = dense_keys[layer_id], dense_values[layer_id]
            if layer_id == self.num_layers - 1:
                self.mirror.commit()
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # [bs, kv_heads, max_seq, head_dim]

        if md.mirror is not None:
            # Decode: each KV head's group of query heads is its rows of queries, one SDPA without
            # enable_gqa over head-major keys (30% faster on the CPU than the padded layout below).
            group_q = q.view(md.bs, num_kv_heads, num_heads // num_kv_heads, head_dim)
            # A few microseconds of work: SDPA's parallel region would only wait for the other threads, which on a
            # busy machine may be descheduled (SmolLM2, one request: 35 us at one thread, up to 600 at two).
            threads = torch.get_num_threads()
            serial = threads > 1 and md.bs * num_kv_heads * md.max_seq <= SERIAL_DECODE_KEYS
            if serial:
                torch.set_num_threads(1)
            try:
                out = F.scaled_dot_product_attention(group_q, keys, values, attn_mask=md.mask, scale=self.scale)
            finally:
                if serial:
                    torch.set_num_threads(threads)
            return out.reshape(md.bs, num_heads * head_dim)
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
