"""The engine: model + KV pool + attention backend; forward is a pure function of the batch."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from minisgl.config import EngineConfig
from minisgl.core import Batch, get_context
from minisgl.errors import ConfigError
from minisgl.kvcache.pool import KVPool

logger = logging.getLogger("minisgl")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but no CUDA GPU is visible: use device='cpu'")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig, model_source: Any = None) -> None:
        from minisgl import plugins
        from minisgl.engine.sampler import Sampler
        from minisgl.models.loader import load_model, resolve_model
        from minisgl.scheduler.table import TableManager
        from minisgl.tokenizer import load_tokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)

        t0 = time.perf_counter()
        if model_source is None:
            self.model_dir = resolve_model(config.model)
            source: Any = self.model_dir
        else:  # a live transformers model (its current weights), see transformers_minisgl
            self.model_dir = None
            source = model_source
        self.model, self.model_config = load_model(
            source, dtype=self.dtype, device=self.device, load_format=config.load_format
        )
        self.tokenizer = getattr(model_source, "_minisgl_tokenizer", None) or (
            load_tokenizer(self.model_dir) if self.model_dir is not None else None
        )
        logger.info(
            "weights loaded: %s (%s, %s on %s) in %.1fs",
            config.model, self.model_config.architecture, str(self.dtype).removeprefix("torch."),
            self.device, time.perf_counter() - t0,
        )

        mc = self.model_config
        self.max_seq_len = min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.page_size = config.page_size
        num_pages = self._num_pages()
        self.kv_pool = KVPool(
            mc.num_layers, num_pages, self.page_size, self._local_kv_heads(), mc.head_dim, self.dtype, self.device
        )
        self.table = TableManager(config.max_running_requests + 2, self.max_seq_len, self.device)
        logger.info(
            "KV pool: %d pages x %d tokens (%.2f GiB)", num_pages, self.page_size,
            self.kv_pool.buffer.numel() * self.kv_pool.buffer.element_size() / 2**30,
        )
        self.attn_backend = self._make_backend(plugins.attention_backends())
        ctx = get_context()
        ctx.attn_backend, ctx.kv_pool = self.attn_backend, self.kv_pool
        self.sampler = Sampler(mc.vocab_size, self.device)

    def _local_kv_heads(self) -> int:
        from minisgl.distributed import get_tp_info

        tp = get_tp_info().size
        return max(1, self.model_config.num_kv_heads // tp)

    def _num_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_pages is not None:
            return cfg.num_pages
        per_page = KVPool.bytes_per_page(mc.num_layers, self.page_size, self._local_kv_heads(), mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.mem_fraction
        else:
            budget = cfg.kv_cache_gb * 2**30
        # Never more than every running request at full length could use.
        cap = (cfg.max_running_requests * self.max_seq_len) // self.page_size + 1
        return max(1, min(int(budget // per_page), cap))

    def _make_backend(self, backends: dict[str, Any]) -> Any:
        name = self.config.attention_backend
        if name == "auto":
            name = "flashinfer" if self.device.type == "cuda" and "flashinfer" in backends else "torch"
        if name not in backends:
            raise ConfigError(f"unknown attention backend {name!r}: available {sorted(backends)}")
        return backends[name](self.model_config, self.kv_pool, self.table.page_table, self.device)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Run the model on the batch; returns logits [num sampled rows, vocab] (float32)."""
        self.attn_backend.prepare(batch)
        ctx = get_context()
        with ctx.forward_batch(batch):
            hidden = self.model(batch.input_ids, batch.positions)
        last = torch.tensor(batch.extend_lens, device=self.device).cumsum(0) - 1
        if not all(batch.sample_mask):
            last = last[torch.tensor(batch.sample_mask, device=self.device)]
        return self.model.compute_logits(hidden[last])
