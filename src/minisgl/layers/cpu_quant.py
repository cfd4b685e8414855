"""The CPU weight formats of `--quantization fp16 / int8` and their GEMMs (CpuGemm packs a weight once per format).

- "fp16": fbgemm's fp16 weights, math in fp32.
- "int8": weight-only int8, one scale per group of 32 inputs (max |w| / 127), fp32 inputs and outputs. Up to
  INT8_KERNEL_ROWS rows (decode) run layers/int8_gemm.c (built for this CPU by layers/cpu_kernel.py); more rows (a
  prefill, a large decode batch), or a machine without a C compiler, run fbgemm's fp16 GEMM over the same int8
  weights widened (exact to 2^-11).
- RESCORED ("int8_top", the LM head): fbgemm's dynamic int8 GEMM (7-bit weights, inputs quantized to 8 bits per
  row), then each row's RESCORED_TOP largest outputs recomputed from the fp32 weight.

Why weight-only int8 per group with fp32 inputs, on SmolLM2-135M (teacher-forced top-1 vs fp32): quantizing the
inputs to 8 bits cost 3 points by itself and 8 bits per channel on every linear 3 more (every linear in fbgemm's
int8: 89%); per channel with fp32 inputs 97.2%, per group of 32 98.4%. torch's own int8-weight kernel (aten's
`_weight_int8pack_mm`) takes only per-channel scales and bf16 inputs, and streams int8 no faster than oneDNN
streams fp32 (docs/benchmarks.md).
"""

from __future__ import annotations

import warnings

import torch

from minisgl.layers import cpu_kernel

INT8_WEIGHT_MAX = 127  # weight-only int8: symmetric per output channel
DYNAMIC_WEIGHT_MAX = 63  # fbgemm's dynamic int8: 7-bit weights, see _pack_dynamic
INT8_KERNEL_ROWS = cpu_kernel.MAX_ROWS  # int8_gemm.c up to this many rows (decode); fbgemm's fp16 GEMM past them
RESCORED = "int8_top"  # the LM head: int8 GEMM, then its RESCORED_TOP largest outputs recomputed in fp32
RESCORED_TOP = 32
KINDS = ("fp16", "int8", RESCORED)


class Int8Weight:
    """An int8 weight [out, in] with one float32 scale per group of cpu_kernel.GROUP inputs (max |w| / 127), packed
    for int8_gemm.c, and the same values widened to fp16 for fbgemm's GEMM (more rows than the kernel takes, or no
    kernel on this machine). Inputs and outputs stay float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        n, k = w.shape
        group = cpu_kernel.GROUP if k % cpu_kernel.GROUP == 0 else k  # an odd width: one scale per channel
        grouped = w.view(n, k // group, group)
        scales = grouped.abs().amax(dim=2).clamp(min=1e-8) / INT8_WEIGHT_MAX
        q = torch.round(grouped / scales[..., None]).clamp_(-INT8_WEIGHT_MAX, INT8_WEIGHT_MAX).to(torch.int8)
        self.bias = None if bias is None else bias.detach().float()
        self.widened = torch.ops.quantized.linear_prepack_fp16((q.float() * scales[..., None]).view(n, k), None)
        self.kernel = cpu_kernel.load() if group == cpu_kernel.GROUP else None
        if self.kernel is not None:
            self.packed = self.kernel.pack(q.view(n, k).contiguous(), scales.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= INT8_KERNEL_ROWS:
            y = self.kernel.gemm(x.contiguous(), *self.packed)
        else:
            y = torch.ops.quantized.linear_dynamic_fp16.default(x, self.widened)
        return y if self.bias is None else y.add_(self.bias)


def pack(kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> object:
    """The packed form of weight (and bias) for kind."""
    if kind == "int8":
        return Int8Weight(weight, bias)
    w = weight.detach().float()
    if kind == "fp16":
        return torch.ops.quantized.linear_prepack_fp16(w, None if bias is None else bias.detach().float())
    return _pack_dynamic(w)


def _pack_dynamic(w: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic int8 weight: symmetric per output channel in 7 bits (scale = max |w| / 63).

    7-bit weights let the inputs keep all 8 bits: AVX2's u8 x s8 pairwise sums (vpmaddubsw) saturate int16 only
    past 2 x 255 x 63 < 32767.
    """
    scales = (w.abs().amax(dim=1).clamp(min=1e-8) / DYNAMIC_WEIGHT_MAX).double()
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's kernels take them
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)  # the bias is added after the row scaling


def run(kind: str, x: torch.Tensor, packed: object, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) over a weight packed for kind, x [rows, in] float32. The fp16 and int8 packs hold their bias;
    RESCORED adds `bias`. Its dynamic int8 GEMM quantizes x per tensor, which is per row in decode (one row per
    request); a prefill's rows are scaled to the same range first, so each is quantized as finely as decode would."""
    # The overloads themselves: an op packet's call first walks its arguments for script objects (the packed weight).
    if kind == "int8":
        return packed(x)
    if kind == "fp16":
        return torch.ops.quantized.linear_dynamic_fp16.default(x, packed)
    linear = torch.ops.quantized.linear_dynamic.default
    if x.shape[0] == 1:
        y = linear(x, packed, False)
    else:
        row_max = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        y = linear(x / row_max, packed, False).mul_(row_max)
    return y if bias is None else y.add_(bias)


def rescore_top(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [rows, out] (x W^T in int8) with each row's RESCORED_TOP largest entries replaced by fp32's exact values: an
    LM head whose candidates for the top tokens are scored as fp32 scores them, at int8's weight bytes."""
    top = y.topk(min(RESCORED_TOP, y.shape[-1]), dim=-1, sorted=False).indices
    rows = weight.index_select(0, top.flatten()).view(*top.shape, weight.shape[-1])
    exact = torch.bmm(rows, x.unsqueeze(-1)).squeeze(-1)
    return y.scatter_(1, top, exact if bias is None else exact + bias[top])


def available(kind: str) -> bool:
    """Whether this torch and CPU run kind's kernels (fbgemm: x86 with AVX2 or AVX-512; aten's int8-weight GEMM),
    checked on a tiny weight at both row counts."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    k = cpu_kernel.GROUP * 2
    try:
        packed = pack(kind, torch.ones(4, k), None)
        ys = [run(kind, torch.ones(rows, k), packed) for rows in (1, INT8_KERNEL_ROWS + 1)]
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return all(torch.allclose(y, torch.full_like(y, float(k)), rtol=0.05) for y in ys)
