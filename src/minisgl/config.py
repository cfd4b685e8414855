"""One frozen config tree for the engine, built from LLM(...) keyword arguments or CLI flags."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from minisgl import env
from minisgl.errors import ConfigError

CACHE_KINDS = ("radix", "naive")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's and SGLang's --kv-cache-dtype names
# --reasoning-parser names (vLLM's and SGLang's); all of these models write <think>...</think>.
REASONING_PARSERS = ("qwen3", "deepseek-r1")
TP_ALLREDUCES = ("nccl", "symm_mem", "fused", "fused_ll")
MOE_PARALLELS = (
    "auto",
    "tp",
    "ep",
)  # MoE experts under TP: whole experts per rank where E divides, each split, or whole


def _from_env(read: Any) -> Any:
    """A field whose default comes from the environment (minisgl.env), read when the config is built."""
    return field(default_factory=read)


def default_of(f: Field) -> Any:
    """An EngineConfig field's default (for those the environment gives, as it reads now)."""
    return f.default_factory() if f.default is MISSING else f.default


# CPU float32 GEMMs over weights kept as fp16 (fp32 math), or partly int8 (layers/linear.py: QUANTIZED_GEMMS)
CPU_QUANTIZATIONS = ("fp16", "int8")
# "fp8": any device; the linears' weights rounded to FP8 per output channel at load (layers/fp8.py)
QUANTIZATIONS = (None, *CPU_QUANTIZATIONS, "fp8")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto": cuda when available, else cpu
    cache: str = "radix"
    page_size: int | None = None  # None: 16 for FlashInfer/XQA attention on a CUDA GPU, else 1 (attention/choice.py)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8_e4m3" (or "fp8") / "fp8_e5m2": half the bytes
    num_pages: int | None = None  # None: sized from memory (mem_fraction on CUDA, kv_cache_gb on CPU)
    kv_cache_gb: float = 1.0  # CPU: memory given to the KV pool
    mem_fraction: float = 0.85  # CUDA: fraction of free memory after weights for the KV pool
    max_prefill_tokens: int = 4096  # token budget of one prefill batch (chunked prefill beyond it)
    # Seconds a decoding request may wait between tokens while prompts prefill (None: 1 on the CPU, 0.1 on a GPU;
    # 0: prefill first, unbounded); the chunk beside decodes adapts to the measured step time (scheduler/budget.py)
    max_decode_gap: float | None = None
    max_running_requests: int = 256
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    tp: int = 1
    nnodes: int = 1  # TP across machines: ranks are split evenly over the nodes
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous (default: a free loopback port)
    dist_timeout: float = 120.0  # seconds before a silent rank is declared dead
    # One CUDA host: "fused_ll" (default) all-reduces with the residual RMSNorm in one kernel ("fused": its variant
    # with a barrier), "symm_mem", "nccl"
    tp_allreduce: str = _from_env(env.TP_ALLREDUCE.get)
    tp_fused_mb: int = _from_env(env.TP_FUSED_MB.get)  # tp_allreduce="fused"/"fused_ll": MB of each of its two slots
    # Opt-in: the decode graphs sample each rank's vocabulary shard and gather only the winners
    tp_vocab_sampling: bool = _from_env(env.TP_VOCAB_SAMPLING.get)
    # MoE under TP: "tp" splits every expert's intermediate dimension, "ep" gives each rank whole experts
    moe_parallel: str = _from_env(env.MOE_PARALLEL.get)
    # multi-node TP: a file (mode 600) with the secret every node shares (or MINISGL_TP_SECRET); distributed/auth.py
    tp_secret_file: str | None = None
    attention_backend: str = "auto"  # "torch", "flashinfer", "fa3", or "PREFILL,DECODE"
    disable_xqa: bool = _from_env(lambda: not env.XQA.get())  # "auto" keeps FlashInfer's decode for fp8 KV on Hopper
    cuda_graph_max_bs: int = 256
    disable_cuda_graph: bool = False
    # Prefill batches of up to this many tokens replay piecewise CUDA graphs (all but attention); 0: eager
    piecewise_cuda_graph_max_tokens: int = _from_env(lambda: 4096 if env.PIECEWISE_GRAPH.get() else 0)
    disable_overlap: bool = False
    load_format: str = "auto"  # "auto" or "dummy" (random weights, for benchmarks)
    seed: int = 0
    schedule_policy: str = "lpm"  # "lpm" (longest prefix match first, fair) or "fcfs"
    reasoning_parser: str | None = None  # "qwen3" / "deepseek-r1": chat answers carry the <think> part apart
    # Limits of one request, each refused with a typed error (HTTP 400) beyond it, so that no request can stall others
    max_n: int = 16  # sequences per request (n)
    max_stop_strings: int = 16  # stop strings per request
    max_stop_string_len: int = 1024  # characters of one stop string
    max_tools: int = 128  # tool definitions per request (OpenAI's limit)
    max_schema_depth: int = 64  # nesting of a JSON schema (response_format, a tool's parameters)
    max_grammar_bytes: int = 65536  # a JSON schema (compact), regex or EBNF grammar
    # characters a request carries (prompt, messages, tools, template variables); a token-id list counts its ids
    max_request_chars: int = 32 * 2**20
    # A text is refused before tokenizing when even this many characters per token overflow the context;
    # None: the vocabulary's longest token (a byte-level token never covers more characters than its own)
    max_chars_per_token: int | None = None
    grammar_compile_timeout: float = 30.0  # seconds a grammar may compile (off the scheduler loop) before it fails
    threads: int | None = None  # CPU threads of each computing process (torch.set_num_threads); None: torch's default
    # CPU: "fp16" or "int8" weights (faster decode); "fp8": weights rounded to FP8 at load (see QUANTIZATIONS)
    quantization: str | None = None
    speculative: str | None = None  # "ngram": draft tokens from the request's own text and the prefix cache, verified
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.cache not in CACHE_KINDS:
            raise ConfigError(f"unknown cache kind {self.cache!r}: use one of {', '.join(CACHE_KINDS)}")
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise ConfigError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens!r}")
        if self.max_decode_gap is not None and not self.max_decode_gap >= 0:
            raise ConfigError(f"max_decode_gap must be >= 0 seconds (0: unbounded), got {self.max_decode_gap!r}")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ConfigError(
                f"piecewise_cuda_graph_max_tokens must be >= 0 (0: eager prefill), got "
                f"{self.piecewise_cuda_graph_max_tokens!r}"
            )
        if self.tp_allreduce not in TP_ALLREDUCES:
            raise ConfigError(f"tp_allreduce must be one of {', '.join(TP_ALLREDUCES)}, got {self.tp_allreduce!r}")
        if self.moe_parallel not in MOE_PARALLELS:
            raise ConfigError(f"moe_parallel must be one of {', '.join(MOE_PARALLELS)}, got {self.moe_parallel!r}")
        if self.tp_fused_mb < 1:
            raise ConfigError(f"tp_fused_mb must be >= 1, got {self.tp_fused_mb!r}")
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests!r}")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp!r}")
        if self.nnodes < 1 or self.tp % self.nnodes:
            raise ConfigError(f"tp ({self.tp}) must be a multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("multi-node TP needs dist_init_addr=HOST:PORT (node 0's address), the same on every node")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {self.num_pages!r}")
        if not self.kv_cache_gb > 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ConfigError(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(
                f"unknown reasoning parser {self.reasoning_parser!r}: choose one of {', '.join(REASONING_PARSERS)}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        for name in ("max_n", "max_stop_strings", "max_stop_string_len", "max_tools", "max_schema_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_request_chars < 1 or (self.max_chars_per_token is not None and self.max_chars_per_token < 1):
            raise ConfigError("max_request_chars and max_chars_per_token must be >= 1 (max_chars_per_token None: auto)")
        if self.max_grammar_bytes < 1 or not self.grammar_compile_timeout > 0:
            raise ConfigError("max_grammar_bytes must be >= 1 and grammar_compile_timeout > 0")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"unknown quantization {self.quantization!r}: use one of {', '.join(map(str, QUANTIZATIONS))}"
            )
        if self.speculative not in (None, "ngram"):
            raise ConfigError(f"unknown speculative decoding {self.speculative!r}: use 'ngram' (or leave it off)")
        if self.dtype not in (None, "float32", "bfloat16", "float16", "auto"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine options: {unknown}; known: {sorted(names - {'extra'})}")
        return cls(model=model, **kwargs)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
