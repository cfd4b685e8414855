"""The engine: model + KV pool + attention backend; forward (+ sample) is a pure function of the batch.

Policy lives with what it chooses: the attention backends and the page size in attention/choice.py, quantization in
layers/quantize.py, the device and dtype in engine/device.py. The engine builds from their answers and runs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from minisgl import env, plugins
from minisgl.attention.choice import AttentionTarget, backend_names, make_backend, page_size_for
from minisgl.config import EngineConfig
from minisgl.core import Batch, Req
from minisgl.distributed import get_tp_info, min_over_ranks
from minisgl.engine.cuda_graph import CudaGraphRunner
from minisgl.engine.device import resolve_device, resolve_dtype, set_threads
from minisgl.engine.outputs import ForwardOutput, embeddings, prompt_logprobs
from minisgl.engine.piecewise import PiecewiseGraphRunner, supports_piecewise
from minisgl.engine.sampler import Sampler, SamplingInfo
from minisgl.engine.verify import Verified, decode_rows, grammar_masks, positions, verify
from minisgl.errors import ConfigError
from minisgl.kvcache.pool import FP8_DTYPES, KVPool
from minisgl.kvcache.table import TableManager
from minisgl.layers import gemv
from minisgl.layers.context import get_context
from minisgl.layers.fp8 import checkpoint_quantization, with_fp8_weights
from minisgl.layers.quantize import check_quantization, is_fp8_on_gpu, quantize_model
from minisgl.models.loader import load_model, resolve_model
from minisgl.tokenizer import TokenizerLoad

logger = logging.getLogger("minisgl")


class Engine:
    def __init__(self, config: EngineConfig, model_source: Any = None) -> None:
        self.config = config

        # ---- device and dtype ----
        self.device = resolve_device(config.device)
        set_threads(config.threads, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_quantization(config.quantization, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

        # ---- model: weights (quantized as asked) and tokenizer ----
        plugins.get_plugin_manager()  # the plugins' architectures and backends added before any is looked up
        self._load_model(model_source)
        if self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16) and env.GEMV.get():
            # before the KV pool takes the free memory and before any graph capture
            tuned = gemv.tune(self.model, fuse=env.GEMV_FUSED.get(), max_rows=env.GEMV_ROWS.get())
            logger.info("GEMMs of 1-%d rows: %d linears take the GEMV (layers/gemv.py)", env.GEMV_ROWS.get(), tuned)
        mc = self.model_config
        self.max_seq_len = min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings)

        # ---- KV pool: its page size and dtype follow the attention backend chosen for them ----
        backends = plugins.attention_backends()
        self.page_size = page_size_for(config, self.device, self.dtype, mc.head_dim)
        self.kv_dtype = FP8_DTYPES.get(config.kv_cache_dtype, self.dtype)
        target = AttentionTarget(self.device, self.dtype, self.kv_dtype, mc.head_dim, self.page_size)
        names = backend_names(config, backends, target)
        # On CUDA one extra page past num_pages is scratch: padded CUDA-graph rows write their KV there.
        self.num_pages = self._num_pages()
        scratch = 1 if self.device.type == "cuda" else 0
        self.kv_pool = KVPool(
            mc.num_layers,
            self.num_pages + scratch,
            self.page_size,
            self._local_kv_heads(),
            mc.head_dim,
            self.kv_dtype,
            self.device,
            model_dtype=self.dtype,
        )
        self.table = TableManager(config.max_running_requests + 2, self.max_seq_len, self.device)
        logger.info(
            "KV pool: %d pages x %d tokens (%.2f GiB, %s)",
            self.num_pages,
            self.page_size,
            self.kv_pool.buffer.numel() * self.kv_pool.buffer.element_size() / 2**30,
            str(self.kv_dtype).removeprefix("torch."),
        )

        # ---- attention backend and sampler ----
        self.attn_backend = make_backend(backends, names, mc, self.kv_pool, self.table.page_table, self.device)
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.attn_backend, self.kv_pool
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)

        # ---- CUDA graphs: decode, and piecewise prefill ----
        self.graph_runner: Any = self._decode_graph_runner()
        self.prefill_graphs: Any = None
        max_tokens = min(config.piecewise_cuda_graph_max_tokens, config.max_prefill_tokens)
        if self._piecewise_ok(max_tokens):
            init_whole = getattr(self.attn_backend, "init_prefill_graphs", None)
            self.prefill_graphs = PiecewiseGraphRunner(
                self.model,
                max_tokens,
                dummy_slot=self.num_pages * self.page_size,
                device=self.device,
                whole_graphs=init_whole is not None and init_whole(self.max_seq_len, self.num_pages),
            )

    def _load_model(self, model_source: Any) -> None:
        """The weights (from config.model, or a live transformers model) and the tokenizer that goes with them."""
        t0 = time.perf_counter()
        if model_source is None:
            self.model_dir = resolve_model(self.config.model)
            source: Any = self.model_dir
        else:  # a live transformers model (its current weights), see transformers_minisgl
            self.model_dir = None
            source = model_source
        # Dummy weights are seeded (the same on every TP rank) without touching the caller's RNG.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.config.seed)
            self.model, self.model_config = load_model(
                source, dtype=self.dtype, device=self.device, load_format=self.config.load_format
            )
        self._quantize()
        self.tokenizer_load = TokenizerLoad(self.model_dir, getattr(model_source, "_minisgl_tokenizer", None))
        quantized = f", {self.config.quantization} weights" if self.config.quantization else ""
        threads = f", {torch.get_num_threads()} threads" if self.device.type == "cpu" else ""
        logger.info(
            "weights loaded: %s (%s, %s on %s%s%s) in %.1fs",
            self.config.model,
            self.model_config.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            quantized,
            threads,
            time.perf_counter() - t0,
        )

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for a live model given without one), loaded on first use."""
        return self.tokenizer_load.get()

    def load_weights(self, weights: Any) -> None:
        """(HF name, tensor) pairs into the running model: FP8 ones dequantized, quantization='fp8' applied again."""
        if is_fp8_on_gpu(self.model):
            raise ConfigError(
                "load_weights into a model whose GEMMs run in FP8 on the GPU is not supported (its weights are e4m3 "
                "now): build a new LLM from the updated checkpoint, or serve the model without quantization='fp8'"
            )
        self.model.load_weights(with_fp8_weights(weights, checkpoint_quantization(self.model_config.hf_config)))
        if self.config.quantization == "fp8":
            self._quantize()

    def _quantize(self) -> None:
        """config.quantization applied to the loaded weights (layers/quantize.py decides how)."""
        quantize_model(self.model, self.config.quantization, self.model_config.hf_config, self.device, self.dtype)

    def _decode_graph_runner(self) -> Any:
        """CUDA graphs for decode batches, where the device, the config and the attention backend allow them."""
        if (
            self.device.type == "cuda"
            and not self.config.disable_cuda_graph
            and self.config.cuda_graph_max_bs > 0
            and getattr(self.attn_backend, "supports_cuda_graph", False)
        ):
            return CudaGraphRunner(
                self.model,
                self.attn_backend,
                min(self.config.cuda_graph_max_bs, self.config.max_running_requests),
                self.model_config.vocab_size,
                self.max_seq_len,
                dummy_page=self.num_pages,
                page_size=self.page_size,
                device=self.device,
                seed=self.config.seed,
                vocab_sampling=self.config.tp_vocab_sampling,
            )
        return None

    def _piecewise_ok(self, max_tokens: int) -> bool:
        """Prefill runs in piecewise CUDA graphs on CUDA GPUs, with a graph-capable backend and a model that
        splits at attention (engine/piecewise.py). Under TP the pieces hold the all-reduces, as decode graphs do:
        every rank replays the same pieces in the same order (the same batch), and a piece's reductions alternate
        the fused all-reduce's two slots starting from the first, as every forward's (an even number a forward)."""
        return (
            self.device.type == "cuda"
            and not self.config.disable_cuda_graph
            and max_tokens > 0
            and getattr(self.attn_backend, "supports_cuda_graph", False)
            and supports_piecewise(self.model)
        )

    def _local_kv_heads(self) -> int:
        tp = get_tp_info().size
        return max(1, self.model_config.num_kv_heads // tp)

    def _num_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_pages is not None:
            return cfg.num_pages
        per_page = KVPool.bytes_per_page(
            mc.num_layers, self.page_size, self._local_kv_heads(), mc.head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.mem_fraction
        else:
            budget = cfg.kv_cache_gb * 2**30
        # Never more than every running request at full length could use.
        cap = (cfg.max_running_requests * self.max_seq_len) // self.page_size + 1
        return min_over_ranks(max(1, min(int(budget // per_page), cap)), self.device)

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (decode and prefill run eager afterwards); every TP rank does it before leaving its
        group."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Run the model on the batch; returns logits [num sampled rows, vocab]: float32, but for a decode batch
        replayed from a CUDA graph, which gives them in the model's dtype (the sampler casts where it needs to)."""
        return self._forward(batch)[0]

    def _forward(
        self, batch: Batch, temperatures: list[float] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the sampled rows' logits, every row's hidden state for a prefill, else None). `temperatures`: a
        decode batch replayed from a CUDA graph samples its rows in the graph (CudaGraphRunner.run)."""
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.attn_backend, self.kv_pool  # several engines may share a process
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch, temperatures), None
        hidden = self._run_model(batch)
        if batch.is_decode:  # one token per request, every one sampled
            return self.model.compute_logits(hidden), None
        # Index of each sampled request's last token, built on the host: no device sync.
        last, end = [], 0
        for extend, sampled in zip(batch.extend_lens, batch.sample_mask or [True] * batch.size):
            end += extend
            if sampled:
                last.append(end - 1)
        rows = torch.tensor(last, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows]), hidden

    @torch.inference_mode()
    def forward_and_sample(self, batch: Batch, sampled: list[Req], bitmask_fn: Any = None) -> ForwardOutput:
        """Queue the forward and the sampling of `sampled`; changes no request (ForwardOutput says what comes
        back). bitmask_fn(logits) applies the grammar masks of `sampled`, or is None."""
        runner = self.graph_runner
        graph = (  # a decode graph that samples (CudaGraphRunner.run): the sampling info may leave it to the graph
            runner is not None
            and runner.sampling is not None
            and runner.can_run(batch)
            and len(sampled) == batch.size
            and bitmask_fn is None
        )
        info = SamplingInfo.from_reqs(sampled, self.model_config.vocab_size, self.device, graph) if sampled else None
        if info is not None and info.in_graph:
            self._forward(batch, info.temperatures)
            return ForwardOutput(runner.next_ids[: batch.size])
        prompt = embedded = None
        if batch.is_prefill and any(r.wants_prompt_logprobs or r.embed for r in batch.reqs):
            logits, hidden = self._forward(batch)
            assert hidden is not None, "a prefill runs eagerly"
            if any(r.wants_prompt_logprobs for r in batch.reqs):
                prompt = prompt_logprobs(batch, hidden, self.model.compute_logits, self.device)
            embedded = embeddings(batch, hidden)
        else:
            logits = self.forward(batch)
        if info is None:
            return ForwardOutput(None, None, prompt, embedded)
        return ForwardOutput(*self.sampler.sample(logits, sampled, info, bitmask_fn), prompt, embedded)

    def _run_model(self, batch: Batch) -> torch.Tensor:
        """The model's hidden states for a batch outside the decode graphs: piecewise prefill graphs, or eager."""
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return self.prefill_graphs.run(batch)  # plans the batch's attention itself
        self.attn_backend.prepare(batch)
        with get_context().forward_batch(batch):
            return self.model(batch.input_ids, batch.positions)

    @torch.inference_mode()
    def forward_and_verify(self, batch: Batch, grammar_apply: Any = None) -> list[Verified]:
        """Run a verify batch (row i extends by its last sampled token and batch.drafts[i]), score every position and
        choose each row's tokens (engine/verify.py); changes no request. grammar_apply(logits, [state]) masks one
        row by one grammar state, or is None."""
        assert batch.drafts is not None, "a verify batch carries its drafts"
        drafts = batch.drafts
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.attn_backend, self.kv_pool
        rows = positions(batch.reqs, drafts)
        logits = self._verify_logits(batch)
        info = SamplingInfo.from_reqs(rows, self.model_config.vocab_size, self.device)
        mask = grammar_masks(rows, drafts, grammar_apply) if grammar_apply is not None else None
        return verify(logits, rows, drafts, info, mask, self.sampler.generator)

    def _verify_logits(self, batch: Batch) -> torch.Tensor:
        """float32 logits at every token of a verify batch (each one is a scored position).

        Where the decode graphs fit, each token runs as a decode row of its own (decode_rows): one graph replay, as a
        decode step costs, and the decode kernels' numerics, as plain decoding has. Else the extend path runs it."""
        if self.graph_runner is not None:
            rows = decode_rows(batch)
            if self.graph_runner.can_run(rows):
                return self.graph_runner.run(rows).float()
        return self.model.compute_logits(self._run_model(batch))
