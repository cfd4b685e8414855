"""A roofline of decode steps: each kernel class's GPU time against the bytes and FLOPs it must move.

`minisgl bench profile gpu` profiles windows of steady decode steps; for each, `report` groups the kernels into
classes by name (GEMMs, attention, MoE experts, norms, RoPE, activation, sampling, KV stores and copies,
all-reduce, the rest), and puts beside each class's GPU time per step:

- the bytes a step must read at least for it (the GEMMs: the weights of every linear and the LM head, plus the
  rows' activations; attention: the KV of every running request; MoE: the experts the batch routes to, uniform
  routing assumed) and its FLOPs;
- what that achieves against the GPU's measured device-to-device copy bandwidth and its measured dense bf16
  matmul rate (`peaks`: the ceilings this GPU reaches, not its datasheet);
- kernels launched per step, and the host time the overlap does not hide (step wall time minus GPU busy time).

The shapes are the throughput benchmark's config dicts (bench/throughput.py), so the bytes are exact for its
dummy models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.bench.throughput import hbm_bandwidth

# First match wins: the MoE kernels before the GEMMs (a grouped GEMM is an expert's), attention before the copies.
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce", ("allreduce", "all_reduce", "AllReduce", "nccl", "cross_device", "oneshot", "twoshot")),
    ("moe experts", ("moe", "Moe", "MoE", "expert", "align_block", "grouped")),
    (
        "attention",
        (
            "Decode",
            "decode",
            "xqa",
            "Xqa",
            "Prefill",
            "prefill",
            "fmha",
            "flash_fwd",
            "FlashAttn",
            "Attention",
            "attention",
        ),
    ),
    ("gemm", ("gemm", "Gemm", "GEMM", "gemv", "nvjet", "cutlass", "sm90_", "xmma", "matmul", "cublas", "splitK")),
    ("norm", ("norm", "Norm")),
    ("rope", ("rope", "Rope", "rotary", "Rotary", "qkv_kernel")),  # layers/fused_qkv.py: q/k norms, RoPE, KV store
    ("activation", ("silu", "Silu", "act_and_mul", "gelu")),
    ("sampling", ("sampl", "Sampl", "topk", "TopK", "top_k", "argmax", "softmax", "Softmax", "gumbel", "sort", "Sort")),
    ("kv store, copies", ("copy", "Copy", "Memcpy", "Memset", "scatter", "Scatter", "index", "Index", "store", "cat")),
)
OTHER = "other (elementwise, reductions)"


# The experts' Triton kernels by their function names: layers/fused_moe.py's (routing, grouping by expert, grouped
# GEMMs, combine) and layers/moe_gemv.py's one-token pair (each routes the token itself).
MOE_KERNELS = frozenset(
    ("route_kernel", "count_kernel", "layout_kernel", "scatter_kernel", "per_expert_kernel", "gemm_kernel")
    + ("combine_kernel", "moe_up_kernel", "moe_down_kernel")
)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name."""
    if name in MOE_KERNELS:
        return "moe experts"
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in name for k in keys)), OTHER)


@dataclass
class Peaks:
    copy_bytes_s: float  # device-to-device copy, bytes read + written per second
    bf16_flop_s: float  # a large bf16 matmul's FLOP/s


def peaks() -> Peaks:
    """This GPU's measured ceilings: copy bandwidth (bench/throughput.py's 4 GiB copy) and an 8192^3 bf16 matmul."""
    import torch  # lazy: `minisgl bench --help` loads every benchmark

    bandwidth = hbm_bandwidth()
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    flop_s = 2 * n**3 * 20 / (start.elapsed_time(end) / 1000)
    del a, b
    torch.cuda.empty_cache()
    return Peaks(bandwidth, flop_s)


def step_costs(c: dict[str, Any], batch: float, kv_tokens: float, fp8: bool = False) -> dict[str, tuple[float, float]]:
    """class -> (bytes, FLOPs) one decode step must move and compute at least: `batch` rows whose requests hold
    `kv_tokens` tokens of KV in all, for a model of shape c (bf16 activations and KV; fp8: one byte per weight of
    the layers' linears and experts)."""
    wb = 1 if fp8 else 2
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    experts, top_k = c.get("num_experts", 0), c.get("num_experts_per_tok", 0)
    inter = c["intermediate_size"]
    attn_linear = h * (q + 2 * kv) + q * h
    mlp_linear = 0 if experts else 3 * h * inter
    router = h * experts
    head = c["vocab_size"] * h
    weight_bytes = wb * layers * (attn_linear + mlp_linear) + 2 * (layers * router + head)
    act_dims = layers * ((h + q + 2 * kv) + (q + h) + (0 if experts else h + 3 * inter)) + h + c["vocab_size"]
    gemm = (weight_bytes + 2 * batch * act_dims, 2 * batch * (layers * (attn_linear + mlp_linear + router) + head))
    kv_bytes = kv_tokens * layers * 2 * kv * 2
    attention = (kv_bytes + 2 * batch * layers * 2 * q, 4 * kv_tokens * layers * q)
    costs = {"gemm": gemm, "attention": attention}
    if experts:
        per_expert = 3 * h * c["moe_intermediate_size"]
        touched = experts * (1 - (1 - top_k / experts) ** batch)
        costs["moe experts"] = (wb * layers * touched * per_expert, 2 * batch * top_k * layers * per_expert)
    return costs


def step_floor(c: dict[str, Any], batch: float, kv_tokens: float, copy_bytes_s: float, fp8: bool = False) -> float:
    """Seconds a decode step's bytes (step_costs', every class) take at the copy bandwidth: its floor."""
    return sum(nbytes for nbytes, _ in step_costs(c, batch, kv_tokens, fp8).values()) / copy_bytes_s


@dataclass
class Window:
    """One profiled stretch of decode steps: the profiler, how many steps, their mean batch and KV tokens, and the
    wall and GPU-busy seconds per step."""

    name: str
    prof: Any
    steps: int
    batch: float
    kv_tokens: float
    wall_s: float
    gpu_s: float


def class_times(prof: Any) -> dict[str, tuple[float, int]]:
    """class -> (GPU seconds, kernels launched) over a torch.profiler run."""
    out: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        device_us = getattr(event, "device_time", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time", 0.0)
        if not device_us or getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
            continue
        cls = kernel_class(event.name)
        seconds, count = out.get(cls, (0.0, 0))
        out[cls] = (seconds + device_us / 1e6, count + 1)
    return out


def report(window: Window, c: dict[str, Any], peak: Peaks, fp8: bool = False) -> list[dict[str, Any]]:
    """Print the window's roofline table; its rows as dicts (for JSON)."""
    times = class_times(window.prof)
    costs = step_costs(c, window.batch, window.kv_tokens, fp8)
    total = sum(s for s, _ in times.values()) / window.steps
    print(
        f"\nroofline: {window.name} ({window.steps} steps, batch {window.batch:.0f}, KV {window.kv_tokens:.0f} tokens;"
        f" copy {peak.copy_bytes_s / 1e9:.0f} GB/s, bf16 {peak.bf16_flop_s / 1e12:.0f} TFLOP/s measured)"
    )
    print(
        f"{'kernel class':32s} {'GPU ms/step':>11s} {'share':>6s} {'launches':>8s} {'GB/step':>8s} {'GB/s':>7s}"
        f" {'of copy':>7s} {'TFLOP/s':>8s} {'of bf16':>7s}"
    )
    rows = []
    for cls, (seconds, count) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        per_step = seconds / window.steps
        nbytes, flops = costs.get(cls, (0.0, 0.0))
        row = dict(kernel_class=cls, gpu_ms_per_step=1000 * per_step, share=per_step / total if total else 0.0)
        row.update(launches_per_step=count / window.steps, gb_per_step=nbytes / 1e9)
        row.update(gb_s=nbytes / per_step / 1e9 if nbytes else None, tflop_s=flops / per_step / 1e12 if flops else None)
        rows.append(row)
        bw = f"{row['gb_s']:7.0f} {nbytes / per_step / peak.copy_bytes_s:7.0%}" if nbytes else f"{'-':>7s} {'-':>7s}"
        fl = f"{row['tflop_s']:8.1f} {flops / per_step / peak.bf16_flop_s:7.0%}" if flops else f"{'-':>8s} {'-':>7s}"
        print(
            f"{cls:32s} {1000 * per_step:11.3f} {row['share']:6.1%} {row['launches_per_step']:8.1f}"
            f" {row['gb_per_step']:8.3f} {bw} {fl}"
        )
    launches = sum(n for _, n in times.values()) / window.steps
    floor = step_floor(c, window.batch, window.kv_tokens, peak.copy_bytes_s, fp8)
    print(
        f"{'all kernels':32s} {1000 * total:11.3f} {'':6s} {launches:8.1f}; step wall {1000 * window.wall_s:.3f} ms,"
        f" GPU busy {1000 * window.gpu_s:.3f} ms, host not hidden {1000 * max(0.0, window.wall_s - window.gpu_s):.3f}"
        f" ms; the step's bytes at copy bandwidth {1000 * floor:.3f} ms ({floor / window.wall_s:.0%} of the wall)"
    )
    return rows
