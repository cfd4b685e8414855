"""Decode attention with TensorRT-LLM's XQA kernel, as FlashInfer ships it (`flashinfer.xqa`), on Hopper.

A decode-only backend: `--attention-backend flashinfer,xqa` (or plain `xqa`, which means the same), and what
"auto" picks for an fp8_e4m3 KV cache on an SM90 GPU when the page size is one XQA takes (16, 32, 64 or 128
tokens). Why (measured on one H100 on the throughput workload's shape, docs/benchmarks.md): over
an fp8 cache XQA's Hopper kernel reads ~2.5-2.75 TB/s where FlashInfer's decode reads ~1.4-1.8 (the throughput
workload: ~24k tok/s against ~18k). Over a bf16 cache it reads 2.76-2.87 TB/s against FlashInfer's 2.70, which
end to end is inside the run-to-run spread, and its batch-1 step is slower: bf16 keeps FlashInfer's decode.
It needs no plan(): the kernel takes a [batch, pages] block table and the sequence lengths, gathered from the
page table on the GPU each step, so a CUDA graph replays it with nothing but buffer fills.

fp8 KV numerics: XQA's Hopper fp8 kernel computes both products on fp8 tensor cores, so the queries (and the
softmax weights) are rounded to fp8 as well as the cache, as TensorRT-LLM does, and vLLM and SGLang with their
TensorRT-LLM kernels. tests/test_gpu.py scores it against fp32 HF with the same fp8 cache rounding, by the bar
FlashInfer's fp8 decode meets. (XQA's generic kernel, which keeps the queries bf16 and upcasts the cache as it
reads it, has FlashInfer's fp8 numerics and is no faster than FlashInfer.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.distributed import get_tp_info
from minisgl.errors import ConfigError

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool
    from minisgl.models.config import ModelConfig

PAGE_SIZES = (16, 32, 64, 128)
SEMAPHORE_BYTES = 8 * 2**20  # XQA's multi-block semaphores: zero before first use, reset by the kernel
SCRATCH_BYTES = 64 * 2**20  # partial results of multi-block (split sequence) runs at small batches


def xqa_supported(device: torch.device, page_size: int, head_dim: int) -> bool:
    """XQA runs here: a Hopper GPU (the one this was measured on), a page size it takes, a head dim it takes."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and page_size in PAGE_SIZES
        and head_dim % 16 == 0
        and 16 <= head_dim <= 256
    )


def block_table(
    page_table: torch.Tensor, rows: torch.Tensor, width: int, page_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[len(rows), width] int32 page ids of the page-table rows `rows` (token slots, int64): the slots at page
    starts (every page_size-th position), divided by page_size; written into out[:len(rows), :width] when given.
    Columns past a request's last page hold whatever the row holds there: the kernel never reads them."""
    slots = page_table[:, : width * page_size : page_size].index_select(0, rows)
    pages = torch.div(slots, page_size, rounding_mode="floor") if page_size > 1 else slots
    if out is None:
        return pages.to(torch.int32)
    out[: pages.shape[0], : pages.shape[1]].copy_(pages)
    return out


class XqaMetadata(NamedTuple):
    table: torch.Tensor  # [bs, pages] int32 page ids
    seq_lens: torch.Tensor  # [bs, 1] uint32
    max_seq_len: int  # table width * page_size


class XqaBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, model_config: "ModelConfig", kv_pool: "KVPool", page_table: torch.Tensor, device: torch.device | str
    ) -> None:
        from flashinfer.utils import get_device_sm_count  # lazy: flashinfer is GPU-only
        from flashinfer.xqa import get_xqa_module  # lazy: flashinfer is GPU-only

        self.device = torch.device(device)
        self.page_size = kv_pool.page_size
        if self.page_size not in PAGE_SIZES:
            raise ConfigError(f"the xqa decode kernel needs page_size in {PAGE_SIZES}, got {self.page_size}")
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device)[0] not in (9, 10, 12):
            raise ConfigError("the xqa decode kernel needs an SM90, SM100 or SM120 GPU")
        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, max_seq_len] int64 token slots, owned by the scheduler
        self.num_qo_heads = model_config.num_heads // get_tp_info().size
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = model_config.head_dim
        self.dtype = kv_pool.model_dtype
        self.fp8_gmma = kv_pool.is_fp8 and torch.cuda.get_device_capability(self.device)[0] == 9
        if kv_pool.is_fp8 and kv_pool.dtype != torch.float8_e4m3fn:
            raise ConfigError("the xqa decode kernel reads an fp8_e4m3 KV cache, not fp8_e5m2")
        self.module = get_xqa_module(
            self.dtype,
            kv_pool.dtype,
            self.page_size,
            self.head_dim,
            self.num_qo_heads // self.num_kv_heads,
            False,
            self.dtype,
        )
        self.sm_count = get_device_sm_count(self.device)
        self.pdl = torch.cuda.get_device_capability(self.device)[0] >= 9
        workspace = torch.zeros(SEMAPHORE_BYTES + SCRATCH_BYTES, dtype=torch.uint8, device=self.device)
        self.semaphores, self.scratch = workspace[:SEMAPHORE_BYTES], workspace[SEMAPHORE_BYTES:]
        # CUDA graphs (init_cuda_graph)
        self._graph_table: torch.Tensor | None = None
        self._graph_lens: torch.Tensor | None = None
        self._dummy_page = 0

    # ------------------------------------------------------------------ metadata

    def _gather(self, batch: "Batch", width: int, table: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's block table (into `table` when given), gathered on the GPU."""
        rows = torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64).to(self.device, non_blocking=True)
        return block_table(self.page_table, rows, width, self.page_size, table)

    def prepare(self, batch: "Batch") -> None:
        if not batch.is_decode:
            raise ConfigError("the xqa backend runs decode batches only: use it as 'PREFILL,xqa'")
        width = -(-max(batch.seq_lens) // self.page_size)
        table = self._gather(batch, width)
        lens = torch.tensor(batch.seq_lens, dtype=torch.int32).view(-1, 1).to(self.device, non_blocking=True)
        batch.attn_metadata = XqaMetadata(table, lens.view(torch.uint32), width * self.page_size)

    # ------------------------------------------------------------------ forward

    def kv_pool_for(self, batch: "Batch") -> "KVPool":
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
        meta: XqaMetadata = batch.attn_metadata
        bs = meta.table.shape[0]
        q = q.reshape(bs, 1, self.num_qo_heads, self.head_dim)
        out = torch.empty_like(q) if out is None else out.view(bs, 1, self.num_qo_heads, self.head_dim)
        self.module.xqa(
            self.fp8_gmma,
            self.sm_count,
            self.num_kv_heads,
            0,
            1.0,
            out,
            1.0,
            q,
            None,
            self.kv_pool.paged_k(layer_id),
            self.kv_pool.paged_v(layer_id),
            meta.table,
            meta.max_seq_len,
            meta.seq_lens,
            bs,
            1.0,
            self.semaphores,
            self.scratch,
            self.pdl,
        )
        return out.view(bs, -1)

    # ------------------------------------------------------------------ CUDA graphs

    def init_cuda_graph(self, max_bs: int, max_seq_len: int, dummy_page: int) -> None:
        """A block table and length buffer shared by every captured batch size; padded rows read dummy_page."""
        width = -(-max_seq_len // self.page_size)
        self._graph_table = torch.full((max_bs, width), dummy_page, dtype=torch.int32, device=self.device)
        self._graph_lens = torch.ones(max_bs, 1, dtype=torch.int32, device=self.device)
        self._dummy_page = dummy_page

    def capture_metadata(self, bs: int) -> XqaMetadata:
        assert self._graph_table is not None and self._graph_lens is not None
        width = self._graph_table.shape[1]
        return XqaMetadata(self._graph_table[:bs], self._graph_lens[:bs].view(torch.uint32), width * self.page_size)

    def prepare_replay(self, batch: "Batch", padded_bs: int) -> None:
        """Fill the graph buffers for batch; rows past batch.size read one token of the dummy page."""
        assert self._graph_table is not None and self._graph_lens is not None
        bs, pad = batch.size, padded_bs - batch.size
        width = -(-max(batch.seq_lens) // self.page_size)
        self._gather(batch, width, self._graph_table)
        self._graph_lens[:bs].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32).view(-1, 1), non_blocking=True)
        if pad:
            self._graph_table[bs:padded_bs, 0] = self._dummy_page
            self._graph_lens[bs:padded_bs] = 1
        batch.attn_metadata = self.capture_metadata(padded_bs)
