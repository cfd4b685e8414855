"""Tensor-parallel linear layers (column- and row-sharded), each with a weight_loader per parameter.

A column-parallel layer holds a slice of the output features on each rank; a row-parallel
layer holds a slice of the input features and all-reduces its partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import env
from minisgl.distributed import all_reduce, get_tp_info, partial_out
from minisgl.errors import WeightsError
from minisgl.layers import cpu_quant
from minisgl.layers.cpu_quant import RESCORED
from minisgl.layers.fp8 import Fp8Weight
from minisgl.layers.fp8_gemm import Fp8Gemm
from minisgl.layers.gemv import GemvConfig, gemv, rows_bucket


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise WeightsError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor | Fp8Weight) -> None:
    """Copy a (sliced) checkpoint tensor into a parameter, failing loudly on a shape mismatch.

    In place on the parameter itself (or a view of it), never through .data: the copy bumps the
    parameter's version counter, which tells CpuGemm that its packed weight is stale. An FP8 weight
    (its shard sliced with its scales) is dequantized into the parameter's dtype: no FP8 GEMM runs here.
    """
    if param.shape != loaded.shape:
        raise WeightsError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if isinstance(loaded, Fp8Weight):
        loaded = loaded.dequantize(param.dtype, param.device)
    with torch.no_grad():
        param.copy_(loaded)


def _onednn_available() -> bool:
    if not env.ONEDNN.get():  # force F.linear (what a CPU without the kernels runs)
        return False
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _torch_says_packable(dtype: torch.dtype) -> bool:
    """torch's own answer: oneDNN's bf16 path needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT."""
    if dtype == torch.bfloat16:
        query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(query()) if query is not None else True  # no query in this build: the probe decides
    return dtype == torch.float32


def _probe_packable(dtype: torch.dtype) -> bool:
    """Pack and run a tiny weight: what the capability query cannot see (a build without the kernel)."""
    try:
        w = torch.ones(4, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, CpuGemm.PACK_BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y.float(), torch.full((2, 4), 4.0)))


_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class CpuGemm:
    """y = x W^T (+ b) through oneDNN with W packed once in its blocked layout, for CPU tensors.

    PyTorch's CPU F.linear goes to MKL, which repacks W on every call; oneDNN with a prepacked
    weight was 1.1-2.4x faster on SmolLM2's shapes on the project's AVX-512 CPU, most at decode
    sizes and on the LM head (`minisgl bench profile cpu-gemm`, docs/benchmarks.md). The packed copy
    follows the weight: it is rebuilt when the weight's storage or version counter changes
    (load_weights, any in-place edit), and it is a second copy of the weights in memory (0.5 GiB for
    SmolLM2 in fp32). Other devices, a dtype this CPU cannot pack (bf16 without AVX-512 or
    AVX-NE-CONVERT), or a build without oneDNN use F.linear.
    """

    enabled = _onednn_available()
    PACK_BATCH_HINT = 32  # oneDNN picks a blocking for this many rows; any row count works
    # dtype -> whether this CPU packs it: asked once per process (torch's query, then a tiny probe).
    packable: dict[torch.dtype, bool] = {}

    quantized_ok: dict[str, bool] = {}  # kind -> fbgemm runs it here: asked once per process

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._packed: torch.Tensor | None = None
        self.quantized: str | None = None  # "int8" / "fp16": set by quantize_gemms
        # CUDA: calls of few rows through layers/gemv.py's kernels, {rows bucket: config} (set by its tune)
        self.gemv: dict[int, GemvConfig] = {}
        self.norm_gemv: dict[int, GemvConfig] = {}  # CUDA, the same buckets: the norm before it in its kernel

    @classmethod
    def supports(cls, kind: str) -> bool:
        if kind not in cls.quantized_ok:
            cls.quantized_ok[kind] = cpu_quant.available(kind)
        return cls.quantized_ok[kind]

    @classmethod
    def packs(cls, dtype: torch.dtype) -> bool:
        """Whether weights of this dtype go through the packed oneDNN path on this CPU."""
        known = cls.packable.get(dtype)
        if known is None:
            known = cls.enabled and dtype in _ONEDNN_DTYPES and _torch_says_packable(dtype) and _probe_packable(dtype)
            cls.packable[dtype] = known
        return known

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantized is not None and weight.device.type == "cpu" and x.dtype == torch.float32:
            return self._quantized(self.quantized, x, weight, bias)
        if self.gemv and x.dim() == 2 and x.stride(-1) == 1 and (config := self.gemv.get(rows_bucket(x.shape[0]))):
            return gemv(x, weight, bias, config)
        if not (weight.device.type == "cpu" and x.dtype == weight.dtype and self.packs(weight.dtype)):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.PACK_BATCH_HINT)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    @staticmethod
    def into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """out [M, N] = x [M, K] W^T (+ b), written where the caller says (distributed.partial_out's buffer)."""
        if bias is None:
            torch.mm(x, weight.t(), out=out)
        else:
            torch.addmm(bias, x, weight.t(), out=out)

    def _quantized(self, kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """layers/cpu_quant.py's GEMM over a weight packed once (re-packed when the weight or bias changes)."""
        key = (weight.data_ptr(), weight._version, bias.data_ptr() if bias is not None else 0)
        if key != self._key:
            self._packed = cpu_quant.pack(kind, weight, bias)
            self._key = key
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the model's activations are 2-D already
        y = cpu_quant.run(kind, x2, self._packed, bias if kind == RESCORED else None)
        if kind == RESCORED:
            y = cpu_quant.rescore_top(y, x2, weight, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


# quantization -> the weight kind of each GEMM (layers/cpu_quant.py), by the name of its module (first match; "" matches
# all). int8: every linear in weight-only int8 per group of 32 inputs, the LM head RESCORED (fp32's logits for the top
# tokens at int8's bytes). On SmolLM2-135M, teacher-forced top-1 vs fp32 on held-out text: 98.4%; per output channel
# instead of per group 97.2%; every linear in fbgemm's dynamic int8 (8-bit inputs) 89-92%. docs/benchmarks.md has
# the speeds.
QUANTIZED_GEMMS: dict[str, tuple[tuple[str, str], ...]] = {
    "fp16": (("", "fp16"),),
    "int8": (("lm_head", RESCORED), ("", "int8")),
}


def quantize_gemms(model: nn.Module, quantization: str) -> int:
    """Route the CPU GEMMs of model (linears and the LM head) through the weight formats QUANTIZED_GEMMS
    gives them; how many GEMMs were switched. ConfigError when this torch or CPU has no such kernels."""
    from minisgl.errors import ConfigError

    rules = QUANTIZED_GEMMS[quantization]
    for _, kind in rules:
        if not CpuGemm.supports(kind):
            raise ConfigError(
                f"quantization={quantization!r} needs torch's {kind} CPU kernels (fbgemm: an x86 CPU with AVX2): "
                "run without quantization"
            )
    switched = 0
    for name, module in model.named_modules():
        gemm = getattr(module, "gemm", None)
        if isinstance(gemm, CpuGemm):
            gemm.quantized = next(kind for suffix, kind in rules if name.endswith(suffix))
            switched += 1
    return switched


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size] local to this rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.gemm: CpuGemm | Fp8Gemm = CpuGemm()  # Fp8Gemm once layers/quantize.py makes the weight FP8

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        copy_checked(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_info().size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        size = param.shape[0]
        copy_checked(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        self.weight.shard_ids = tuple(range(len(output_sizes)))
        if self.bias is not None:
            self.bias.shard_ids = self.weight.shard_ids

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        assert isinstance(shard_id, int), "merged linear shards are loaded one projection at a time"
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_checked(param.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks.

    When tp_size > total_num_kv_heads each KV head is replicated on tp_size / total_num_kv_heads ranks.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_info().size
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            divide(tp_size, total_num_kv_heads)
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)
        self.weight.shard_ids = ("q", "k", "v")
        if self.bias is not None:
            self.bias.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if shard_id == "q":
            offset, size, head_start = 0, self.q_size, self.tp_rank * self.num_heads
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            # Ranks that share a replicated KV head all load that same head.
            replicas = max(1, self.tp_size // self.total_num_kv_heads)
            head_start = (self.tp_rank // replicas) * self.num_kv_heads
        else:
            raise WeightsError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        src = loaded.narrow(0, head_start * self.head_dim, size)
        copy_checked(param.narrow(0, offset, size), src)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_info().size), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # bias: full on every rank, added once (rank 0) before the reduce
            copy_checked(param, loaded)
            return
        size = param.shape[1]
        copy_checked(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x W^T summed over the ranks; reduce=False: this rank's partial sums, for a norm that reduces them
        itself (RMSNorm.reduce_forward), written where its fused kernel reads them (distributed.partial_out)."""
        bias = self.bias if self.tp_rank == 0 else None
        out = None if reduce or self.tp_size == 1 else partial_out(x.numel() // x.shape[-1], self.output_size, x.dtype)
        if out is None:
            y = self.gemm(x, self.weight, bias)
            return all_reduce(y) if reduce else y
        self.gemm.into(out, x.reshape(-1, x.shape[-1]), self.weight, bias)
        return out.view(*x.shape[:-1], self.output_size)
