"""Every MINISGL_* environment variable, declared once with its type, default and what it does.

The only module that reads os.environ for minisgl's own settings. A variable is read when its value is asked
for (`env.RUNTIME_DIR.get()`), not at import, so a variable set later (a test's monkeypatch) takes effect. The
engine settings among them only give EngineConfig's defaults (minisgl.config): an `LLM(...)` keyword or a
`minisgl serve --flag` overrides them. An empty value counts as unset. `python -m minisgl.env` prints the table of
the README's "Environment variables" section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from minisgl.errors import ConfigError

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"not a boolean: use one of {', '.join(_TRUE + _FALSE)}")


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: read and parsed on each get(); the default where it is unset or empty."""

    name: str
    kind: str  # the type as the table shows it
    default: T
    parse: Callable[[str], T]
    doc: str
    choices: tuple[str, ...] = ()

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""

    def get(self) -> T:
        raw = os.environ.get(self.name, "")
        if raw == "":
            return self.default
        if self.choices and raw not in self.choices:
            raise ConfigError(f"${self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ConfigError(f"${self.name}={raw!r} is not a valid {self.kind} ({e}): fix or unset it") from e


VARIABLES: list[EnvVar[Any]] = []


def _declare(name: str, kind: str, default: T, parse: Callable[[str], T], doc: str, **kw: Any) -> EnvVar[T]:
    var = EnvVar(name, kind, default, parse, doc, **kw)
    VARIABLES.append(var)
    return var


# Where things live.
RUNTIME_DIR = _declare(
    "MINISGL_RUNTIME_DIR",
    "path",
    None,
    _path,
    "daemons' sockets and registry files (else `$XDG_RUNTIME_DIR/minisgl`, else `~/.cache/minisgl/run`)",
)
CACHE_DIR = _declare(
    "MINISGL_CACHE_DIR",
    "path",
    None,
    _path,
    "cache root: GGUF models converted once go to `<dir>/models`, resolved configs to `<dir>/configs` "
    "(else under `~/.cache/minisgl`)",
)


def cache_root() -> Path:
    """Where minisgl caches what it builds once: $MINISGL_CACHE_DIR, else ~/.cache/minisgl."""
    return CACHE_DIR.get() or Path.home() / ".cache" / "minisgl"


CURVE_DIR = _declare(
    "MINISGL_CURVE_DIR",
    "path",
    None,
    _path,
    "CURVE key directory of `minisgl keys` and CURVE daemons (else `~/.config/minisgl/curve`)",
)
CURVE_CLIENT_KEY = _declare(
    "MINISGL_CURVE_CLIENT_KEY",
    "path",
    None,
    _path,
    "clients: this client's CURVE secret key file (with `MINISGL_CURVE_SERVER_KEY`: talk to a CURVE daemon)",
)
CURVE_SERVER_KEY = _declare(
    "MINISGL_CURVE_SERVER_KEY", "path", None, _path, "clients: the CURVE daemon's public key file"
)
ADDRESS = _declare(
    "MINISGL_ADDRESS",
    "str",
    None,
    str,
    "the daemon address `ChatMiniSGL` and `MiniSGLEmbeddings` use by default (read through LangChain's `from_env`)",
)
API_KEY = _declare(
    "MINISGL_API_KEY",
    "str",
    None,
    str,
    "`minisgl serve --http-port`: the HTTP API's key when `--api-key` / `--api-key-file` are not given; "
    "`ChatMiniSGL`'s `api_key` as a LangChain secret (`langchain_core.load` reads it from this variable)",
)
IDLE_TIMEOUT = _declare(
    "MINISGL_IDLE_TIMEOUT",
    "float",
    0.0,
    float,
    "`minisgl serve`: stop after this many seconds without a request (0: never; `--idle-timeout` overrides); "
    "auto-started daemons take it too, and 300 where it is unset",
)
TP_SECRET = _declare(
    "MINISGL_TP_SECRET",
    "str",
    None,
    str,
    "multi-node tensor parallelism: the secret every node shares, which signs the ranks' messages and keys their "
    "encrypted control channel (or "
    "`--tp-secret-file`, a file only its owner can read); a one-node engine makes its own",
)
PARENT_PID = _declare(
    "MINISGL_PARENT_PID",
    "int",
    None,
    int,
    "set by minisgl on the commands it starts (benchmark children, tensor-parallel ranks): they end with that process",
)

# Engine settings: EngineConfig's defaults.
XQA = _declare(
    "MINISGL_XQA",
    "bool",
    True,
    _bool,
    '`attention_backend="auto"` decodes an fp8_e4m3 KV cache on Hopper with XQA; 0 keeps FlashInfer\'s decode '
    "(`EngineConfig.disable_xqa`)",
)
PIECEWISE_GRAPH = _declare(
    "MINISGL_PIECEWISE_GRAPH",
    "bool",
    True,
    _bool,
    "CUDA: prefill replays piecewise CUDA graphs; 0 runs it eager (`piecewise_cuda_graph_max_tokens` defaults to 0)",
)
TP_ALLREDUCE = _declare(
    "MINISGL_TP_ALLREDUCE",
    "str",
    "fused_ll",
    str,
    "TP on one CUDA host: `fused_ll` sums a row-parallel projection's partial sums, adds the residual and applies the "
    "RMSNorm in one symmetric-memory kernel, each rank storing its rows into its peers' memory (no barrier); `fused` "
    "the same kernel reading the peers' memory after a barrier (1.07x NCCL's throughput on 2x H200; `fused_ll` 1.02x "
    "`fused` on a MoE, 7% faster at batch 1), `symm_mem` all-reduces up to 8 MB "
    "through symmetric memory, `nccl` NCCL's all-reduce (fastest to report a dead rank); several hosts and the CPU "
    "always take the process group's (`EngineConfig.tp_allreduce`)",
    choices=("nccl", "symm_mem", "fused", "fused_ll"),
)
TP_FUSED_MB = _declare(
    "MINISGL_TP_FUSED_MB",
    "int",
    8,
    int,
    "`tp_allreduce=fused` / `fused_ll`: MB of each of its two symmetric-memory slots (`EngineConfig.tp_fused_mb`)",
)
FP8_WEIGHT_ONLY_ROWS = _declare(
    "MINISGL_FP8_WEIGHT_ONLY_ROWS",
    "int",
    1,
    int,
    "FP8 weights on a GPU: GEMMs of up to this many rows widen the FP8 weight in the kernel (inputs unquantized); "
    "more rows quantize the inputs per row and run an FP8 x FP8 GEMM (layers/fp8_gemm.py)",
)
FP8_W8A8_ROWS = _declare(
    "MINISGL_FP8_W8A8_ROWS",
    "int",
    64,
    int,
    "FP8 weights on a GPU: FP8 x FP8 GEMMs of up to this many rows run minisgl's Triton kernel (tiles for decode "
    "batches), more rows torch._scaled_mm (layers/fp8_gemm.py)",
)
MOE_PARALLEL = _declare(
    "MINISGL_MOE_PARALLEL",
    "str",
    "auto",
    str,
    "TP with MoE models: `ep` gives rank r of P the whole experts `[r*E/P, (r+1)*E/P)` (E a multiple of P); `tp` "
    "splits each expert's intermediate dimension across the ranks; `auto`: `ep` where P divides E (1.06x `tp` at "
    "TP=2 on 2x H200), else `tp`; attention and Qwen2-MoE's shared expert stay split either way "
    "(`EngineConfig.moe_parallel`)",
    choices=("auto", "tp", "ep"),
)
TP_VOCAB_SAMPLING = _declare(
    "MINISGL_TP_VOCAB_SAMPLING",
    "bool",
    True,
    _bool,
    "TP on CUDA: the decode graphs sample each rank's vocabulary shard and gather only the winners, not the logits "
    "(`EngineConfig.tp_vocab_sampling`; 1.02x on average over four paired runs on 2x H200); 0 gathers the logits",
)
GEMV = _declare(
    "MINISGL_GEMV",
    "bool",
    True,
    _bool,
    "CUDA: 0 keeps cuBLAS for GEMMs of 1-4 rows (no GEMV timing at start-up, layers/gemv.py) and the grouped GEMMs for "
    "one token's experts (layers/moe_gemv.py)",
)
GEMV_ROWS = _declare(
    "MINISGL_GEMV_ROWS",
    "int",
    4,
    int,
    "CUDA: GEMMs of up to this many rows (1, 2 or 4) may run as the GEMV where it times faster than cuBLAS "
    "(layers/gemv.py); 1 keeps cuBLAS for every call of two rows or more",
)
GEMV_FUSED = _declare(
    "MINISGL_GEMV_FUSED",
    "bool",
    True,
    _bool,
    "CUDA: 0 keeps the RMSNorm (and SiLU-and-mul) of a GEMM of 1-4 rows in kernels of their own (layers/gemv.py)",
)
ONEDNN = _declare(
    "MINISGL_ONEDNN",
    "bool",
    True,
    _bool,
    "CPU: 0 runs linears with `F.linear` instead of oneDNN's packed kernels (what a CPU without them runs)",
)

# Tests and benchmarks.
TOKENIZER_DIR = _declare(
    "MINISGL_TOKENIZER_DIR",
    "path",
    None,
    _path,
    "tests and GPU benchmarks: a directory with SmolLM2's tokenizer files, used instead of the hub",
)
GPU_REPORT = _declare(
    "MINISGL_GPU_REPORT",
    "path",
    None,
    _path,
    "`tests/test_gpu.py` and `minisgl bench throughput`: also write the figures as JSON to this file",
)


def markdown_table() -> str:
    """The README's table of variables."""
    rows = ["| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
    for var in VARIABLES:
        kind = " \\| ".join(f"`{c}`" for c in var.choices) if var.choices else var.kind
        default = "unset" if var.default is None else f"`{_shown(var.default)}`"
        rows.append(f"| `{var.name}` | {kind} | {default} | {var.doc} |")
    return "\n".join(rows) + "\n"


def _shown(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


if __name__ == "__main__":
    print(markdown_table(), end="")
