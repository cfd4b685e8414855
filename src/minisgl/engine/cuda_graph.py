"""CUDA graphs for decode: one graph per batch size of a ladder, replayed on static input buffers.

A decode batch of size bs runs the graph of the smallest captured size >= bs. The padded rows
read token 0 at position 0 and write their KV into a scratch page past the pool's usable pages,
so they never touch a request's KV. Graphs share one memory pool (captured largest first).

Each graph ends with the sampling of its rows (engine/gumbel.py: temperature draws and greedy argmax over
the logits in the model's dtype, Triton) when the GPU has Triton: a batch whose rows need nothing else
(no top-k/top-p/min-p, penalties, masks, logprobs or seeded generator) gets its next ids from the replay
itself; any other batch leaves the rows' temperatures at -1 (the kernels skip them) and samples the logits.

Under tensor parallelism with tp_vocab_sampling (the default) each rank samples its own shard of the vocabulary
inside the graph and the ranks all-gather only each program's winner (a few KB) instead of the logits (a batch of
256 on a 152k vocabulary: 78 MB in bf16, gathered, then copied twice); a batch sampled outside the graph gathers its
logits after the replay.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch, Phase
from minisgl.layers.context import get_context
from minisgl.layers.embedding import ParallelLMHead

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("minisgl")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: "nn.Module",
        attn_backend: Any,
        max_bs: int,
        vocab_size: int,
        max_seq_len: int,
        dummy_page: int,
        page_size: int,
        device: torch.device,
        seed: int = 0,
        vocab_sampling: bool = False,
    ) -> None:
        """vocab_sampling (EngineConfig.tp_vocab_sampling): under TP each rank samples its own vocabulary shard."""
        from minisgl.engine import gumbel

        self.model = model
        self.attn_backend = attn_backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = device
        self.dummy_slot = dummy_page * page_size
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_loc = torch.full((self.max_bs,), self.dummy_slot, dtype=torch.int64, device=device)
        # The LM head's own dtype (half the bytes of float32); the sampler casts where it needs float32.
        dtype = next(model.parameters()).dtype
        self.logits = torch.empty(self.max_bs, vocab_size, dtype=dtype, device=device)
        # In-graph sampling (gumbel.sample_into): per-row temperatures (-1: the row is sampled outside), next ids.
        self.sampling = gumbel.Workspace(self.max_bs, vocab_size, device, seed) if gumbel.usable(device) else None
        lm_head = getattr(model, "lm_head", None)
        self.local_logits: torch.Tensor | None = None  # this rank's vocabulary shard, when it samples it itself
        if self.sampling is not None and isinstance(lm_head, ParallelLMHead) and lm_head.tp_size > 1 and vocab_sampling:
            import torch.distributed as dist

            width = lm_head.weight.shape[0]
            self.local_logits = torch.empty(self.max_bs, width, dtype=dtype, device=device)
            self.sampling = gumbel.Workspace(
                self.max_bs,
                width,
                device,
                seed,
                shards=lm_head.tp_size,
                shard=lm_head.tp_rank,
                col0=lm_head.vocab_start,
                gather=dist.all_gather_into_tensor,
            )
        self._sample_into = gumbel.sample_into
        self.temperature = torch.full((self.max_bs,), -1.0, dtype=torch.float32, device=device)
        self.next_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self._temperatures_set = False  # the buffer holds a batch's temperatures (else -1 everywhere)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        attn_backend.init_cuda_graph(self.max_bs, max_seq_len, dummy_page)
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        ctx = get_context()
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
            batch.attn_metadata = self.attn_backend.capture_metadata(bs)
            with ctx.forward_batch(batch):
                self._forward(bs)  # warm-up: JIT builds, lazily made buffers, allocator state
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "CUDA graphs: %d decode batch sizes up to %d captured in %.1fs, %.2f GiB",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - t0,
            used / 2**30,
        )

    def _batch(self, bs: int) -> Batch:
        return Batch(
            reqs=[],
            phase=Phase.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_loc=self.out_loc[:bs],
            table_rows=self.input_ids[:bs],
            prefix_lens=[0] * bs,
            extend_lens=[1] * bs,
            seq_lens=[1] * bs,
            sample_mask=[True] * bs,
            padded_size=bs,
        )

    def _forward(self, bs: int) -> None:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        lm_head = getattr(self.model, "lm_head", None)
        if self.local_logits is not None:  # this rank's columns only (run() gathers them when they are needed)
            local = self.local_logits[:bs]
            torch.mm(hidden, lm_head.weight.t(), out=local)
            valid = local[:, : lm_head.vocab_end - lm_head.vocab_start]  # the last shard's padding rows: not tokens
            self._sample_into(valid, self.temperature[:bs], self.next_ids[:bs], self.sampling)
            return
        if isinstance(lm_head, ParallelLMHead) and lm_head.tp_size == 1:  # the GEMM writes the buffer itself
            torch.mm(hidden, lm_head.weight.t(), out=self.logits[:bs])
        elif lm_head is not None:
            self.logits[:bs].copy_(lm_head(hidden))
        else:
            self.logits[:bs] = self.model.compute_logits(hidden)
        if self.sampling is not None:
            self._sample_into(self.logits[:bs], self.temperature[:bs], self.next_ids[:bs], self.sampling)

    def release(self) -> None:
        """Free the captured graphs. Before a process group is destroyed: graphs that captured NCCL collectives
        keep its communicator busy, and ncclCommDestroy then never returns (pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.sizes if s >= bs)

    def run(self, batch: Batch, temperatures: list[float] | None = None) -> torch.Tensor:
        """Logits [batch.size, vocab] of a decode batch in the model's dtype (a view of a static buffer: read
        before the next run). With `temperatures` (one per row, 0 for greedy; only when self.sampling), the
        replay also samples the rows: their next ids are self.next_ids[:batch.size] (static too)."""
        bs = batch.size
        padded = self.padded_size(bs)
        batch.padded_size = padded
        if temperatures is not None:
            assert self.sampling is not None and len(temperatures) == bs
            # Rows past bs keep whatever they held: the kernels sample them too, and nothing reads them.
            self.temperature[:bs].copy_(torch.tensor(temperatures, dtype=torch.float32), non_blocking=True)
            self._temperatures_set = True
        elif self._temperatures_set:
            self.temperature.fill_(-1.0)
            self._temperatures_set = False
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_loc[:bs].copy_(batch.out_loc)
        if padded > bs:
            self.out_loc[bs:padded].fill_(self.dummy_slot)
        self.attn_backend.prepare_replay(batch, padded)
        self.graphs[padded].replay()
        if self.local_logits is not None and temperatures is None:  # the caller samples: every rank's columns
            self.logits[:bs].copy_(self.model.lm_head.gather(self.local_logits[:bs]))
        return self.logits[:bs]
