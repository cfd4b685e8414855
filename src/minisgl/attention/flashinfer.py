"""FlashInfer attention: paged prefill/extend (FA2, or FA3 on Hopper) and tensor-core paged decode.

The page table holds token slots; FlashInfer wants page ids, so a request's pages are
page_table[row, 0:seq_len:page_size] // page_size, gathered for the whole batch on the GPU
(no host sync). plan() runs once per batch in prepare(); the layers' forward only stores
K/V and runs the planned kernel. Decode batches replayed from CUDA graphs use one
graph-mode wrapper per captured batch size over shared fixed-size index buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from minisgl.attention.base import AttentionBackend
from minisgl.distributed import get_tp_info

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool
    from minisgl.models.config import ModelConfig

# FlashInfer's float scratch (split-KV partial outputs). A graph-mode prefill plan sizes it for its whole padded grid:
# the one-request prefill graphs on the Qwen3-30B-A3B shape (32 query heads, 66 tiles of 128 rows) take 138 MB.
WORKSPACE_BYTES = 256 * 2**20


# Decode runs FlashInfer's tensor-core kernel (its prefill kernel) for every batch: on the throughput workload
# (H100, Qwen3-0.6B shape, GQA group 2) it reads the KV faster over the run than the CUDA-core kernel (4.91 s of
# decode attention against 5.14 s, pages of 16 against pages of 1) and was 0.5-2% faster end to end in every A/B
# (docs/benchmarks.md), at the small batches too, where it reads slower but the step is short.

# Decode graphs of fewer rows than this split each request's KV into chunks (merged by a second kernel); larger
# ones run one chunk per request. FlashInfer's graph-mode plan always splits, since a graph's batch is captured
# before its lengths are known, so every replay pays the merge kernel and a float32 round trip of the output,
# while from ~32 requests (x 8 KV heads) up the requests alone fill the GPU: over the throughput workload's
# batches one chunk per request read the KV 1.4% faster (one H100, docs/benchmarks.md).
GRAPH_SPLIT_KV_BELOW = 32


def graph_split_kv(bs: int) -> bool:
    """Whether the decode graph of bs rows splits each request's KV (capture and every replay plan alike)."""
    return bs < GRAPH_SPLIT_KV_BELOW


class FlashInferMetadata(NamedTuple):
    wrapper: Any  # a planned BatchPrefill/BatchDecodeWithPagedKVCacheWrapper


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self,
        model_config: "ModelConfig",
        kv_pool: "KVPool",
        page_table: torch.Tensor,
        device: torch.device | str,
        prefill_backend: str = "fa2",
    ) -> None:
        from flashinfer import (  # lazy: flashinfer is GPU-only
            BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
        )

        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, max_seq_len] int64 token slots, owned by the scheduler
        self.device = torch.device(device)
        self.page_size = kv_pool.page_size
        self.num_qo_heads = model_config.num_heads // get_tp_info().size
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = model_config.head_dim
        self.scale = model_config.head_dim**-0.5
        self.dtype = kv_pool.model_dtype  # the queries'
        self.kv_dtype = kv_pool.dtype  # the pool's: fp8 with kv_cache_dtype="fp8_e4m3"
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        # plan() fills a pinned host buffer and queues its copy to the GPU without waiting. With
        # overlap scheduling the next batch is planned before the GPU has run that copy, so
        # consecutive plans alternate between two pinned buffers.
        nbytes = self.decode_wrapper._pin_memory_int_workspace_buffer.numel()
        self._pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._flip = 0
        self._qo_indptr = torch.arange(1, dtype=torch.int32)  # host 0..bs for the graph replans, grown on demand
        # CUDA graphs (init_cuda_graph)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._dummy_page = 0
        self._graph_padding: dict[int, _GraphPadding] = {}  # graph batch sizes planned without a KV split
        self.prefill_backend = prefill_backend
        self._prefill_graph_bufs: tuple[torch.Tensor, ...] | None = None  # init_prefill_graphs
        self._prefill_graph_wrappers: dict[int, Any] = {}

    # ------------------------------------------------------------------ metadata

    def _page_ids(self, rows: list[int], num_pages: list[int]) -> torch.Tensor:
        """int32 page ids of every request, concatenated: one gather from the page table on the GPU, its flat
        indices computed on the host and copied in one go (each tensor op costs host time a decode step waits for
        when nothing overlaps it: a speculative verify step)."""
        ps, stride = self.page_size, self.page_table.stride(0)
        counts = np.asarray(num_pages, dtype=np.int64)
        # flat slot index of page j of request i: row_i * stride + j * ps
        base = np.asarray(rows, dtype=np.int64) * stride - (np.cumsum(counts) - counts) * ps
        flat = np.repeat(base, counts) + np.arange(int(counts.sum()), dtype=np.int64) * ps
        slots = self.page_table.view(-1).index_select(0, torch.from_numpy(flat).to(self.device, non_blocking=True))
        return (slots // ps if ps > 1 else slots).to(torch.int32)

    def _paging(self, seq_lens: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        ps = self.page_size
        num_pages = [-(-s // ps) for s in seq_lens]
        indptr = [0]
        for n in num_pages:
            indptr.append(indptr[-1] + n)
        last = [s - (n - 1) * ps for s, n in zip(seq_lens, num_pages)]
        return num_pages, torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32)

    def _next_pinned(self, wrapper: Any) -> None:
        wrapper._pin_memory_int_workspace_buffer = self._pinned[self._flip]
        self._flip ^= 1

    def _plan_decode(
        self,
        wrapper: Any,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        split_kv: bool = True,
        padding: "_GraphPadding | None" = None,
        pad_row: int = 0,
        seq_lens: list[int] | None = None,
    ) -> None:
        """Plan a decode wrapper; with seq_lens (every row's KV length), a graph's wrapper planned at capture."""
        self._next_pinned(wrapper)
        if padding is not None:
            padding.fill(wrapper._pin_memory_int_workspace_buffer, pad_row)
        if seq_lens is not None:
            self._replan_graph(wrapper, indptr, indices, last, seq_lens, split_kv)
            return
        wrapper.plan(
            indptr,
            indices,
            last,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            disable_split_kv=not split_kv,
        )

    def prepare(self, batch: "Batch") -> None:
        rows = [r.table_idx for r in batch.reqs]
        num_pages, indptr, last = self._paging(batch.seq_lens)
        indices = self._page_ids(rows, num_pages)
        if batch.is_decode:
            self._plan_decode(self.decode_wrapper, indptr, indices, last)
            batch.attn_metadata = FlashInferMetadata(self.decode_wrapper)
            return
        self._plan_prefill(self.prefill_wrapper, batch.extend_lens, indptr, indices, last)
        batch.attn_metadata = FlashInferMetadata(self.prefill_wrapper)

    def _plan_prefill(
        self, wrapper: Any, extend_lens: list[int], indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor
    ) -> None:
        qo_indptr = [0]
        for e in extend_lens:
            qo_indptr.append(qo_indptr[-1] + e)
        self._next_pinned(wrapper)
        wrapper.plan(
            torch.tensor(qo_indptr, dtype=torch.int32),
            indptr,
            indices,
            last,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )

    # ------------------------------------------------------------------ forward

    def kv_pool_for(self, batch: "Batch") -> KVPool:
        return self.kv_pool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        batch: "Batch",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k is not None and v is not None:
            self.kv_pool.store(layer_id, batch.out_loc, k, v)
        buf = self.kv_pool.buffer  # the whole buffer: it may hold a scratch page past num_pages
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        kv = (buf[0, layer_id].view(shape), buf[1, layer_id].view(shape))
        into = None if out is None else out.view(q.shape)
        result = batch.attn_metadata.wrapper.run(q.contiguous(), kv, out=into)
        return result.view(result.shape[0], -1)

    # ------------------------------------------------------------------ CUDA graphs

    def init_cuda_graph(self, max_bs: int, max_seq_len: int, dummy_page: int) -> None:
        """Fixed-size index buffers shared by every captured batch size; padded rows read dummy_page."""
        dev = self.device
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_indices = torch.zeros(max_bs * -(-max_seq_len // self.page_size), dtype=torch.int32, device=dev)
        self._dummy_page = dummy_page

    def capture_metadata(self, bs: int) -> FlashInferMetadata:
        """A graph-mode decode wrapper for batch size bs, planned on bs one-token rows of the dummy page."""
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper  # lazy: flashinfer is GPU-only

        assert self._graph_indptr is not None and self._graph_indices is not None
        assert self._graph_last_page_len is not None
        wrapper = BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._graph_wrappers[bs] = wrapper
        indices = torch.full((bs,), self._dummy_page, dtype=torch.int32, device=self.device)
        split_kv = graph_split_kv(bs)
        plan = (torch.arange(bs + 1, dtype=torch.int32), indices, torch.ones(bs, dtype=torch.int32))
        self._plan_decode(wrapper, *plan, split_kv=split_kv)
        if not split_kv:  # now that the plan's layout is known: plan again with the padded blocks filled
            self._graph_padding[bs] = _GraphPadding(wrapper._plan_info, bs)
            self._plan_decode(wrapper, *plan, split_kv=False, padding=self._graph_padding[bs])
        return FlashInferMetadata(wrapper)

    def prepare_replay(self, batch: "Batch", padded_bs: int) -> None:
        """Plan the graph wrapper of padded_bs for batch; rows past batch.size read the dummy page."""
        pad = padded_bs - batch.size
        seq_lens = list(batch.seq_lens) + [1] * pad
        num_pages, indptr, last = self._paging(seq_lens)
        indices = self._page_ids([r.table_idx for r in batch.reqs], num_pages[: batch.size])
        if pad:
            indices = torch.cat([indices, indices.new_full((pad,), self._dummy_page)])
        wrapper = self._graph_wrappers[padded_bs]
        padding = self._graph_padding.get(padded_bs)
        pad_row = 0
        if padding is not None:  # its padded blocks redo one row: a dummy row (one token), else the shortest request
            pad_row = padded_bs - 1 if pad else min(range(batch.size), key=batch.seq_lens.__getitem__)
        split_kv = padding is None
        self._plan_decode(wrapper, indptr, indices, last, split_kv, padding, pad_row, seq_lens=seq_lens)
        batch.attn_metadata = FlashInferMetadata(wrapper)

    def _replan_graph(
        self,
        wrapper: Any,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        seq_lens: list[int],
        split_kv: bool,
    ) -> None:
        """wrapper.plan() for a graph-mode tensor-core wrapper already planned at capture (flashinfer 0.5.3).

        The same buffer copies and the same scheduler call as plan(), with the KV lengths and their maximum taken from
        the host list: plan() derives them from indptr and takes the maximum with Python's max() over a tensor, one
        tensor op per row (about 2 ms of host time at 256 rows, most of a decode step's scheduling).
        """
        bs = len(seq_lens)
        wrapper._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)
        wrapper._paged_kv_last_page_len_buf.copy_(last, non_blocking=True)
        wrapper._paged_kv_indices_buf[: len(indices)].copy_(indices, non_blocking=True)
        if len(self._qo_indptr) < bs + 1:
            self._qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
        wrapper._max_kv_len = max(seq_lens)
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
            self._qo_indptr[: bs + 1],  # one query row per request
            indptr,
            torch.tensor(seq_lens, dtype=torch.int32),
            bs,  # total query rows
            bs,
            self.num_qo_heads,
            self.num_kv_heads,
            self.page_size,
            True,  # CUDA graph mode
            self.head_dim,
            self.head_dim,
            False,  # causal
            -1,  # window_left
            -1,  # fixed_split_size
            not split_kv,  # disable_split_kv
            0,  # num_colocated_ctas
        )

    # ------------------------------------------------------------------ one-request prefill CUDA graphs

    def init_prefill_graphs(self, max_seq_len: int, dummy_page: int) -> bool:
        """Index buffers for the one-request prefill graphs of engine/piecewise.py; False where they cannot run here.

        They replay FlashInfer's FA2 prefill in graph mode: a wrapper captured for up to n query rows of one request
        launches a fixed grid planned for n rows, and each replay's plan (prepare_prefill_replay) fills its tiles
        for the request's own rows and KV (a graph-mode plan always splits the KV; the merge is in the graph).
        FA3's prefill is left to the eager path."""
        if self.prefill_backend != "fa2":
            return False
        dev, pages = self.device, -(-max_seq_len // self.page_size)
        self._prefill_graph_bufs = (
            torch.zeros(2, dtype=torch.int32, device=dev),  # qo_indptr
            torch.zeros(2, dtype=torch.int32, device=dev),  # paged_kv_indptr
            torch.zeros(pages, dtype=torch.int32, device=dev),  # paged_kv_indices
            torch.ones(1, dtype=torch.int32, device=dev),  # paged_kv_last_page_len
        )
        self._dummy_page = dummy_page
        return True

    def capture_prefill_metadata(self, tokens: int) -> FlashInferMetadata:
        """The graph-mode prefill wrapper for one request of up to `tokens` query rows, planned on that many rows of
        the dummy page (the plan's grid, fixed from here on, is sized by them)."""
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper  # lazy: flashinfer is GPU-only

        assert self._prefill_graph_bufs is not None, "init_prefill_graphs first"
        qo, kv_indptr, indices, last = self._prefill_graph_bufs
        wrapper = BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=qo,
            paged_kv_indptr_buf=kv_indptr,
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=last,
            backend="fa2",
        )
        self._prefill_graph_wrappers[tokens] = wrapper
        num_pages, page_indptr, page_last = self._paging([tokens])
        dummy = torch.full((num_pages[0],), self._dummy_page, dtype=torch.int32, device=self.device)
        self._plan_prefill(wrapper, [tokens], page_indptr, dummy, page_last)
        return FlashInferMetadata(wrapper)

    def prepare_prefill_replay(self, batch: "Batch", tokens: int) -> None:
        """Plan the prefill graph of `tokens` rows for batch, one request of at most that many new tokens."""
        assert batch.size == 1 and batch.extend_lens[0] <= tokens
        num_pages, indptr, last = self._paging(batch.seq_lens)
        indices = self._page_ids([batch.reqs[0].table_idx], num_pages)
        wrapper = self._prefill_graph_wrappers[tokens]
        self._plan_prefill(wrapper, batch.extend_lens, indptr, indices, last)
        batch.attn_metadata = FlashInferMetadata(wrapper)


class _GraphPadding:
    """The padded blocks of a graph-mode FlashInfer plan without a KV split (flashinfer 0.5.3).

    A graph-mode plan launches a fixed grid of `padded_batch_size` blocks, more than the batch's (one per request
    here). With a split it also writes a mask that makes the extra blocks return at once; without one there is no
    mask, and the extra blocks run whatever request/tile indices the plan's pinned host buffer holds past the
    batch's, which the plan does not write. Here that buffer is shared with other plans (it alternates under
    overlap scheduling), so they would be stale indices of another batch: an out-of-bounds read. fill() points
    them at one row of the batch instead, whose output they then write again, with the same values.
    """

    def __init__(self, plan_info: Any, bs: int) -> None:
        info = [int(x) for x in plan_info]  # PrefillPlanInfo::ToVector
        assert len(info) == 15 and info[13] == 1 and info[14] == 0, f"unexpected FlashInfer plan layout {info}"
        self.bs, self.padded = bs, info[0]
        self.offsets = (info[4], info[5], info[6])  # request, q tile and KV tile indices: int32[padded] each

    def fill(self, pinned: torch.Tensor, row: int) -> None:
        if self.padded > self.bs:
            for offset, value in zip(self.offsets, (row, 0, 0)):
                pinned[offset : offset + 4 * self.padded].view(torch.int32)[self.bs :] = value
