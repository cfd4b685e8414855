"""Piecewise CUDA graphs for prefill: every kernel of a forward but attention, replayed per token-count size.

A prefill batch's attention depends on each request's prefix and length (FlashInfer plans it per batch), but
the rest of a decoder is row-wise: the embedding, the norms, the projections, the MLP, the fused q/k-norm +
RoPE + KV store. So a forward of T tokens is padded to the smallest captured size n >= T and run as L + 1
graphs (before the first attention, between each two, after the last), with attention run eagerly on the T
real rows in between. Static buffers carry what crosses a boundary: q (and k, v where no fused store runs),
the attention output, the residual. Padded rows write their KV into the scratch page past the pool's usable
pages, as decode graphs' padded rows do. An eager prefill pays Python and a launch for each of ~9 kernels a
layer (10-13 ms a 28-layer forward on the H100's host, longer than the GPU needs for a 4,096-token chunk);
a replay is one launch per piece (SGLang's and vLLM's piecewise CUDA graphs do the same).

A prefill of one request and at most WHOLE_GRAPH_MAX_TOKENS new tokens (a chat turn, an agent's tool result, a
short prompt: the time to its first token) replays one graph of the whole forward instead, attention included,
where the backend can plan a graph-mode prefill (FlashInfer's FA2: attention/flashinfer.py, prepare_prefill_replay):
28 eager attention calls and 29 replays cost ~1.5 ms of host time that a 128-token prefill's GPU work does not hide.

The model contract: model.model.embed_tokens, .layers (each with attention_input / attention_output and
self_attn.attn, the AttentionLayer) and .norm, as models/llama.py has.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from minisgl.core import Batch, Phase
from minisgl.layers.context import get_context

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("minisgl")

WHOLE_GRAPH_MAX_TOKENS = 256


def piecewise_sizes(max_tokens: int) -> list[int]:
    """16, 32, ..., 256, then every multiple of 512 up to max_tokens (and max_tokens itself)."""
    sizes = [s for s in (16, 32, 64, 128, 256) if s < max_tokens] + list(range(512, max_tokens + 1, 512))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def supports_piecewise(model: "nn.Module") -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return (
        layers is not None
        and len(layers) > 0
        and hasattr(inner, "embed_tokens")
        and hasattr(inner, "norm")
        and all(callable(getattr(layers[0], m, None)) for m in ("attention_input", "attention_output"))
    )


def _keep(buf: torch.Tensor, x: torch.Tensor) -> None:
    """buf holds x afterwards (nothing to do where x was computed in buf itself)."""
    if x.data_ptr() != buf.data_ptr():
        buf.copy_(x)


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: "nn.Module",
        max_tokens: int,
        dummy_slot: int,
        device: torch.device,
        use_graphs: bool = True,
        whole_graphs: bool = False,
    ) -> None:
        """use_graphs=False runs the same pieces eagerly (the CPU tests check the splitting and the padding).
        whole_graphs: the attention backend made its one-request prefill graph buffers (init_prefill_graphs)."""
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.dummy_slot = dummy_slot
        self.device = device
        self.use_graphs = use_graphs
        attn = self.layers[0].self_attn
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        dtype = next(model.parameters()).dtype
        hidden_size = self.norm.weight.shape[0]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.full((n,), dummy_slot, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(n, heads * head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.fused_store = False  # whether the pieces store k, v themselves (set by the capture)
        self.pieces: dict[int, list[Callable[[], Any]]] = {}
        self.whole: dict[int, Callable[[], Any]] = {}  # one-request prefills: the whole forward's graph by size
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._capture()
        if use_graphs and whole_graphs:
            self._capture_whole()

    def _piece(self, i: int, n: int) -> Callable[[], None]:
        """Piece i of a forward of n rows: i = 0 the embedding and layer 0 up to attention; 0 < i < L the rest of
        layer i - 1 and layer i up to attention; i = L the rest of the last layer and the final norm."""
        last = len(self.layers)

        def run() -> None:
            if i == 0:
                hidden, residual = self.embed(self.input_ids[:n]), None
            else:
                hidden, residual = self.layers[i - 1].attention_output(self.attn_out[:n], self.residual[:n])
            if i == last:
                hidden, _ = self.norm.reduce_forward(hidden, residual)
                _keep(self.hidden[:n], hidden)
                return
            q, k, v, residual = self.layers[i].attention_input(
                self.positions[:n], hidden, residual, self.out_loc[:n], q_out=self.q[:n]
            )
            _keep(self.residual[:n], residual)
            _keep(self.q[:n], q)
            self.fused_store = k is None
            if k is not None and v is not None:
                self.k[:n].copy_(k)
                self.v[:n].copy_(v)

        return run

    def _attend(self, layer: "nn.Module", rows: int) -> None:
        """Layer's attention over the first `rows` rows of the static buffers, into self.attn_out."""
        k, v = (None, None) if self.fused_store else (self.k[:rows], self.v[:rows])
        layer.self_attn.attn(self.q[:rows], k, v, out=self.attn_out[:rows])

    def _whole_forward(self, n: int) -> Callable[[], None]:
        """Every piece of a forward of n rows with attention between them (captured as one graph)."""
        pieces = [self._piece(i, n) for i in range(len(self.layers) + 1)]

        def run() -> None:
            pieces[0]()
            for layer, piece in zip(self.layers, pieces[1:]):
                self._attend(layer, n)
                piece()

        return run

    def _probe(self, n: int) -> Batch:
        """A one-request prefill batch of n rows over the static buffers: what captures run under (the backend's
        kv_pool_for reads it); every row writes its KV into the scratch slot."""
        return Batch(
            reqs=[],
            phase=Phase.PREFILL,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_loc=self.out_loc[:n],
            table_rows=self.input_ids[:1],
            prefix_lens=[0],
            extend_lens=[n],
            seq_lens=[n],
            sample_mask=[True],
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        ctx = get_context()
        probe = self._probe(self.max_tokens)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        with ctx.forward_batch(probe):
            for size in reversed(self.sizes):
                fns = [self._piece(i, size) for i in range(len(self.layers) + 1)]
                for fn in fns:  # warm-up: JIT builds, cuBLAS's choices, allocator state (and fused_store)
                    fn()
                if not self.use_graphs:
                    self.pieces[size] = fns
                    continue
                torch.cuda.synchronize(self.device)
                replays = []
                for fn in fns:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        fn()
                    if pool is None:
                        pool = graph.pool()
                    self.graphs.append(graph)
                    replays.append(graph.replay)
                self.pieces[size] = replays
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info(
                "CUDA graphs: prefill in %d pieces for %d sizes up to %d tokens captured in %.1fs, %.2f GiB",
                len(self.layers) + 1,
                len(self.sizes),
                self.max_tokens,
                time.perf_counter() - t0,
                used / 2**30,
            )

    @torch.inference_mode()
    def _capture_whole(self) -> None:
        """One graph per size up to WHOLE_GRAPH_MAX_TOKENS for one-request prefills, attention included."""
        ctx = get_context()
        backend = ctx.attn_backend
        t0 = time.perf_counter()
        pool = self.graphs[0].pool() if self.graphs else None
        for n in reversed([s for s in self.sizes if s <= WHOLE_GRAPH_MAX_TOKENS]):
            probe = self._probe(n)
            try:
                probe.attn_metadata = backend.capture_prefill_metadata(n)
            except Exception as e:  # noqa: BLE001 - e.g. a plan larger than the backend's workspace: eager for n
                logger.warning("one-request prefill graph of %d tokens not captured (%s): piecewise instead", n, e)
                continue
            fn = self._whole_forward(n)
            with ctx.forward_batch(probe):
                fn()  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    fn()
            pool = graph.pool()
            self.graphs.append(graph)
            self.whole[n] = graph.replay
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: one-request prefills of up to %d tokens whole (%d sizes) captured in %.1fs",
            max(self.whole, default=0),
            len(self.whole),
            time.perf_counter() - t0,
        )

    def can_run(self, batch: Batch) -> bool:
        return batch.is_prefill and 0 < batch.input_ids.shape[0] <= self.max_tokens

    def padded_size(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    def run(self, batch: Batch) -> torch.Tensor:
        """The final hidden states [T, hidden_size] of a prefill batch (a view of a static buffer: read it before the
        next run). Plans the batch's attention itself (the whole graphs plan their own wrapper)."""
        tokens = batch.input_ids.shape[0]
        n = self.padded_size(tokens)
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.out_loc[:tokens].copy_(batch.out_loc)
        if n > tokens:  # stale ids and positions are valid indices; stale slots would overwrite someone's KV
            self.out_loc[tokens:n].fill_(self.dummy_slot)
        ctx = get_context()
        whole = self.whole.get(n) if batch.size == 1 else None
        if whole is not None:
            ctx.attn_backend.prepare_prefill_replay(batch, n)
            whole()
            return self.hidden[:tokens]
        ctx.attn_backend.prepare(batch)
        pieces = self.pieces[n]
        with ctx.forward_batch(batch):
            pieces[0]()
            for layer, piece in zip(self.layers, pieces[1:]):
                self._attend(layer, tokens)
                piece()
        return self.hidden[:tokens]

    def release(self) -> None:
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.pieces.clear()
        self.whole.clear()
