"""The engine: model + KV pool + attention backend; forward (+ sample) is a pure function of the batch."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from minisgl import plugins
from minisgl.config import CPU_QUANTIZATIONS, EngineConfig
from minisgl.core import Batch, Req
from minisgl.engine.threads import default_threads
from minisgl.errors import ConfigError
from minisgl.kvcache.pool import FP8_DTYPES, KVPool
from minisgl.layers.context import get_context
from minisgl.layers.fused import FLASHINFER_HEAD_DIMS

logger = logging.getLogger("minisgl")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but no CUDA GPU is visible: use device='cpu'")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig, model_source: Any = None) -> None:
        from minisgl.engine.sampler import Sampler
        from minisgl.kvcache.table import TableManager

        self.config = config
        self.device = resolve_device(config.device)
        threads = config.threads
        if threads is None and self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            threads = default_threads()  # physical cores, not torch's count of logical CPUs
        if threads is not None:  # every computing process builds one Engine: the one place to set it
            torch.set_num_threads(threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.quantization in CPU_QUANTIZATIONS and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ConfigError(
                f"quantization={config.quantization!r} is a CPU float32 mode (device {self.device}, dtype "
                f"{str(self.dtype).removeprefix('torch.')}): use device='cpu' without a dtype, or drop quantization"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

        plugins.get_plugin_manager()  # the plugins' architectures and backends added before any is looked up
        self._load_model(model_source)

        mc = self.model_config
        self.max_seq_len = min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.page_size = self._page_size()
        self.kv_dtype = FP8_DTYPES.get(config.kv_cache_dtype, self.dtype)
        backend_names = self._backend_names(plugins.attention_backends())
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
        self.attn_backend = self._make_backend(plugins.attention_backends(), backend_names)
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.attn_backend, self.kv_pool
        self.sampler = Sampler(mc.vocab_size, self.device, seed=config.seed)
        self.graph_runner: Any = self._decode_graph_runner()
        self.prefill_graphs: Any = None
        max_tokens = min(config.piecewise_cuda_graph_max_tokens, config.max_prefill_tokens)
        if self._piecewise_ok(max_tokens):
            from minisgl.engine.piecewise import PiecewiseGraphRunner

            self.prefill_graphs = PiecewiseGraphRunner(
                self.model, max_tokens, dummy_slot=self.num_pages * self.page_size, device=self.device
            )

    def _load_model(self, model_source: Any) -> None:
        """The weights (from config.model, or a live transformers model) and the tokenizer that goes with them."""
        from minisgl.models.loader import load_model, resolve_model
        from minisgl.tokenizer import load_tokenizer

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
        self.tokenizer = getattr(model_source, "_minisgl_tokenizer", None) or (
            load_tokenizer(self.model_dir) if self.model_dir is not None else None
        )
        logger.info(
            "weights loaded: %s (%s, %s on %s) in %.1fs",
            self.config.model,
            self.model_config.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - t0,
        )

    def load_weights(self, weights: Any) -> None:
        """(HF name, tensor) pairs into the running model: FP8 ones dequantized, quantization='fp8' applied again."""
        from minisgl.layers.fp8 import checkpoint_quantization, with_fp8_weights
        from minisgl.layers.quantize import is_fp8_on_gpu

        if is_fp8_on_gpu(self.model):
            raise ConfigError(
                "load_weights into a model whose GEMMs run in FP8 on the GPU is not supported (its weights are e4m3 "
                "now): build a new LLM from the updated checkpoint, or serve the model without quantization='fp8'"
            )
        self.model.load_weights(with_fp8_weights(weights, checkpoint_quantization(self.model_config.hf_config)))
        if self.config.quantization == "fp8":
            self._quantize()

    def _quantize(self) -> None:
        """config.quantization applied to the loaded weights: fp16/int8 CPU GEMMs, or FP8 (GEMMs in FP8 on a GPU
        that has them, for quantization='fp8' and FP8 checkpoints alike; else rounding in the model's dtype)."""
        from minisgl.layers.fp8 import checkpoint_quantization
        from minisgl.layers.fp8_gemm import supported
        from minisgl.layers.linear import quantize_gemms
        from minisgl.layers.quantize import quantize_model_fp8, to_fp8_gemms

        fp8_checkpoint = checkpoint_quantization(self.model_config.hf_config) is not None
        if (self.config.quantization == "fp8" or fp8_checkpoint) and supported(self.device, self.dtype):
            # A block-wise checkpoint was dequantized at load: its weights are re-quantized here per channel.
            converted = to_fp8_gemms(self.model)
            logger.info("fp8: %d weights in e4m3 with per-channel scales, FP8 GEMMs", converted)
        elif self.config.quantization == "fp8":
            if fp8_checkpoint:
                logger.info("fp8: the checkpoint's weights are FP8 already; not rounded again")
                return
            rounded = quantize_model_fp8(self.model)
            logger.info("fp8: %d weights rounded to FP8 per channel, computed in %s", rounded, self.dtype)
        elif self.config.quantization is not None:
            quantize_gemms(self.model, self.config.quantization)

    def _decode_graph_runner(self) -> Any:
        """CUDA graphs for decode batches, where the device, the config and the attention backend allow them."""
        if (
            self.device.type == "cuda"
            and not self.config.disable_cuda_graph
            and self.config.cuda_graph_max_bs > 0
            and getattr(self.attn_backend, "supports_cuda_graph", False)
        ):
            from minisgl.engine.cuda_graph import CudaGraphRunner

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
        """Prefill runs in piecewise CUDA graphs on one CUDA GPU, with a graph-capable backend and a model that
        splits at attention (engine/piecewise.py). Not under TP yet: the pieces would capture the all-reduces,
        which has not been checked on several GPUs."""
        from minisgl.distributed import get_tp_info
        from minisgl.engine.piecewise import supports_piecewise

        return (
            self.device.type == "cuda"
            and not self.config.disable_cuda_graph
            and max_tokens > 0
            and getattr(self.attn_backend, "supports_cuda_graph", False)
            and get_tp_info().size == 1
            and supports_piecewise(self.model)
        )

    def _local_kv_heads(self) -> int:
        from minisgl.distributed import get_tp_info

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
        return _min_over_ranks(max(1, min(int(budget // per_page), cap)), self.device)

    def _page_size(self) -> int:
        """config.page_size, or when it is None ("auto"): 16 where FlashInfer (or XQA) attention runs on a CUDA GPU,
        1 elsewhere. On the throughput workload FlashInfer reads pages of 16 ~4% faster than single-token pages
        (one H100, docs/benchmarks.md), and 16 is vLLM's default block size; the radix cache then shares
        prefixes in whole pages of 16 tokens. CPU attention and FA3 prefill keep single-token pages."""
        if self.config.page_size is not None:
            return self.config.page_size
        name = self.config.attention_backend
        gpu = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        flashinfer = name in ("flashinfer", "xqa", "flashinfer,xqa") or (name == "auto" and self._flashinfer_fits())
        return 16 if gpu and flashinfer else 1

    def _flashinfer_fits(self) -> bool:
        """FlashInfer is installed and takes this model's head size ("auto" runs torch-native attention otherwise)."""
        return self.model_config.head_dim in FLASHINFER_HEAD_DIMS and _importable("flashinfer")

    def _backend_names(self, backends: dict[str, Any]) -> tuple[str, str]:
        """(prefill, decode) backend names from "auto", "NAME" or "PREFILL,DECODE"."""
        name = self.config.attention_backend
        if name == "auto":
            gpu = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
            name = "flashinfer" if gpu and "flashinfer" in backends and self._flashinfer_fits() else "torch"
            if gpu and name == "torch" and not _importable("flashinfer"):
                logger.warning("flashinfer is not installed: torch-native attention (pip install minisgl[gpu])")
            elif gpu and name == "torch":
                logger.warning(
                    "head_dim %d: FlashInfer's kernels take %s; torch-native attention, no CUDA graphs",
                    self.model_config.head_dim,
                    "/".join(map(str, FLASHINFER_HEAD_DIMS)),
                )
            if name == "flashinfer" and self._auto_xqa(backends):
                name = "flashinfer,xqa"
            elif name == "flashinfer" and self._auto_xqa(backends, 16):  # fp8 on Hopper, pages XQA does not take
                logger.info(
                    "an fp8 KV cache with page_size 16 (32, 64, 128) decodes with XQA's fp8 kernel, "
                    "~1.3x the throughput of FlashInfer's fp8 decode on this GPU (docs/benchmarks.md)"
                )
        if name == "xqa":  # a decode kernel: FlashInfer prefills
            name = "flashinfer,xqa"
        parts = [p.strip() for p in name.split(",")]
        if len(parts) not in (1, 2) or not all(parts):
            raise ConfigError(f"attention backend must be NAME or PREFILL,DECODE, got {name!r}")
        if parts[0] == "xqa":
            raise ConfigError("'xqa' is a decode kernel: name a prefill backend first, e.g. 'flashinfer,xqa'")
        for part in parts:
            if part not in backends:
                raise ConfigError(f"unknown attention backend {part!r}: available {sorted(backends)}")
            if part != "torch" and self.device.type != "cuda":
                raise ConfigError(f"attention backend {part!r} needs a CUDA GPU: use 'torch' on {self.device}")
            if part != "torch" and self.dtype not in (torch.float16, torch.bfloat16):
                raise ConfigError(f"attention backend {part!r} needs dtype bfloat16 or float16, got {self.dtype}")
            if part in ("flashinfer", "fa3") and self.model_config.head_dim not in FLASHINFER_HEAD_DIMS:
                raise ConfigError(
                    f"attention backend {part!r} takes head_dim {', '.join(map(str, FLASHINFER_HEAD_DIMS))}; this "
                    f"model's is "
                    f"{self.model_config.head_dim}: use 'torch' (or 'auto')"
                )
        if self.kv_dtype != self.dtype and parts[0] == "fa3":
            raise ConfigError(
                "an fp8 KV cache needs FlashInfer's FA2 prefill (attention_backend 'flashinfer'), not 'fa3'"
            )
        return parts[0], parts[-1]

    def _auto_xqa(self, backends: dict[str, Any], page_size: int | None = None) -> bool:
        """XQA decodes an fp8_e4m3 KV cache when "auto" is asked on a Hopper GPU whose page size it takes
        (attention/xqa.py: ~1.5x FlashInfer's fp8 decode reads there) unless disable_xqa keeps FlashInfer's decode."""
        from minisgl.attention.xqa import xqa_supported

        return (
            "xqa" in backends
            and not self.config.disable_xqa
            and self.kv_dtype == torch.float8_e4m3fn
            and xqa_supported(self.device, page_size or self.page_size, self.model_config.head_dim)
        )

    def _make_backend(self, backends: dict[str, Any], names: tuple[str, str]) -> Any:
        prefill, decode = names
        args = (self.model_config, self.kv_pool, self.table.page_table, self.device)
        if prefill == decode:
            return backends[prefill](*args)
        from minisgl.attention.hybrid import HybridBackend

        return HybridBackend(backends[prefill](*args), backends[decode](*args))

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
        self.attn_backend.prepare(batch)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            hidden = self.prefill_graphs.run(batch)
        else:
            with ctx.forward_batch(batch):
                hidden = self.model(batch.input_ids, batch.positions)
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

    def _prompt_logprobs(self, batch: Batch, hidden: torch.Tensor) -> dict[int, list[Any]]:
        """{batch row: logprob entries of the prompt tokens this chunk predicts} for the requests that want them.

        A request's rows cover positions cached_len .. cached_len + extend - 1; row p predicts token p + 1,
        a prompt token while p + 1 < prompt_len (the last prompt position predicts the first output token).
        """
        from minisgl.engine.sampler import token_logprobs

        out: dict[int, list[Any]] = {}
        offset = 0
        for i, (req, extend) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if req.wants_prompt_logprobs:
                start, stop = req.cached_len, min(req.cached_len + extend, req.prompt_len - 1)
                targets = torch.tensor(req.input_ids[start + 1 : stop + 1], dtype=torch.int64).to(self.device)
                out[i] = token_logprobs(
                    self.model.compute_logits,
                    hidden[offset : offset + max(0, stop - start)],
                    targets,
                    req.sampling_params.prompt_logprobs,
                )
            offset += extend
        return out

    @torch.inference_mode()
    def forward_and_sample(
        self, batch: Batch, sampled: list[Req], bitmask_fn: Any = None
    ) -> tuple[torch.Tensor | None, list[Any] | None, dict[int, list[Any]] | None, dict[int, list[float]] | None]:
        """Queue the forward and the sampling of `sampled`; changes no request. Returns the next ids (on the
        device; None when nothing is sampled: a middle chunk of a prompt, its KV only), their logprobs,
        the prompt logprobs of the batch rows that asked for them (SamplingParams.prompt_logprobs) or None,
        and the embeddings of the embedding requests whose prompt ends in this chunk ({row: vector}) or None;
        these two wait for the device. bitmask_fn(logits) applies the grammar masks of `sampled`, or is None.
        """
        from minisgl.engine.sampler import SamplingInfo

        prompt = embeddings = None
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
            return runner.next_ids[: batch.size], None, None, None
        if batch.is_prefill and any(r.wants_prompt_logprobs or r.embed for r in batch.reqs):
            logits, hidden = self._forward(batch)
            assert hidden is not None, "a prefill runs eagerly"
            if any(r.wants_prompt_logprobs for r in batch.reqs):
                prompt = self._prompt_logprobs(batch, hidden)
            embeddings = self._embeddings(batch, hidden)
        else:
            logits = self.forward(batch)
        if info is None:
            return None, None, prompt, embeddings
        return (*self.sampler.sample(logits, sampled, info, bitmask_fn), prompt, embeddings)

    def _embeddings(self, batch: Batch, hidden: torch.Tensor) -> dict[int, list[float]] | None:
        """{batch row: L2-normalised float32 hidden state of the last prompt token} for the embedding requests
        whose prompt this chunk finishes (last-token pooling, as vLLM pools decoder models)."""
        rows, ends, end = [], [], 0
        for i, (req, extend) in enumerate(zip(batch.reqs, batch.extend_lens)):
            end += extend
            if req.embed and req.cached_len + extend == req.prompt_len:
                rows.append(i)
                ends.append(end - 1)
        if not rows:
            return None
        last = hidden[torch.tensor(ends, device=hidden.device)].float()
        vectors = torch.nn.functional.normalize(last, dim=-1).tolist()
        return dict(zip(rows, vectors))


def _min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest n over the TP ranks: every rank must schedule on the same pool size (free memory differs a
    little)."""
    from minisgl.distributed import get_tp_info

    if get_tp_info().size == 1:
        return n
    import torch.distributed as dist

    if not dist.is_initialized():
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
