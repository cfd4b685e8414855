"""Per-rank step profiles for tensor parallelism: torch.profiler over a run of steps, summarised per step.

Every rank starts and stops at the same step boundary (the "profile" op travels with the step's other
ops, see runtime/ranks.py), so the figures of the ranks cover the same steps. Each rank writes
rank{R}.json (per-step wall, host and wait times, GPU time by kernel category), rank{R}.txt
(torch's key_averages table) and rank{R}.trace.json.gz (the timeline, for chrome://tracing or Perfetto) under the
directory given at start.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

# Kernel name fragments (lower case) per category; the first category that matches wins.
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("nccl",)),
    ("attention", ("flashinfer", "batchdecode", "batchprefill", "mergestates", "fmha", "flash_fwd", "attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk", "sm90_", "sm80_")),
    ("sampling", ("sampling", "softmax", "argmax", "topk", "sort", "exponential", "multinomial", "renorm")),
    ("memcpy", ("memcpy", "memset")),
)
# CUDA runtime calls in which the host waits for the device.
HOST_WAITS = frozenset({"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"})


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


class RankProfiler:
    """torch.profiler around the steps of one rank, with the step loop's own wall and wait times."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.step_s: list[float] = []
        self.wait_s = 0.0  # waiting for rank 0's ops (ranks > 0) or sending them (rank 0)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def record_step(self, wait_s: float, step_s: float) -> None:
        self.wait_s += wait_s
        self.step_s.append(wait_s + step_s)

    def stop(self) -> dict[str, Any]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        steps = max(1, len(self.step_s))
        averages = self.prof.key_averages()
        gpu: dict[str, float] = {}
        kernels: list[tuple[str, float]] = []
        host_wait_us = 0.0
        for avg in averages:
            if avg.key in HOST_WAITS:
                host_wait_us += avg.self_cpu_time_total
            device_us = _self_device_us(avg)
            if device_us > 0 and _is_device_event(avg):
                category = kernel_category(avg.key)
                gpu[category] = gpu.get(category, 0.0) + device_us
                kernels.append((avg.key, device_us))
        kernels.sort(key=lambda kv: -kv[1])
        ms = lambda us: round(us / 1000 / steps, 3)  # noqa: E731 - total microseconds -> ms per step
        busy = sum(self.step_s) - self.wait_s
        summary = {
            "rank": self.rank,
            "steps": len(self.step_s),
            "wall_ms_per_step": round(wall * 1000 / steps, 3),
            "step_ms": [round(s * 1000, 3) for s in self.step_s],  # in step order
            "ops_wait_ms_per_step": round(self.wait_s * 1000 / steps, 3),
            "device_wait_ms_per_step": ms(host_wait_us),
            "host_ms_per_step": round(max(0.0, busy * 1e6 - host_wait_us) / 1000 / steps, 3),
            "gpu_ms_per_step": {k: ms(v) for k, v in sorted(gpu.items())},
            "gpu_total_ms_per_step": ms(sum(gpu.values())),
            "top_kernels": [(name[:120], ms(us)) for name, us in kernels[:15]],
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        (self.out_dir / f"rank{self.rank}.txt").write_text(averages.table(sort_by=sort_by, row_limit=60))
        self.prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json.gz"))  # gzipped by torch
        return summary


def _self_device_us(avg: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(avg, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_device_event(avg: Any) -> bool:
    """A kernel / memcpy (its time is GPU time), not a CPU op whose children ran on the GPU."""
    device_type = getattr(avg, "device_type", None)
    return device_type is not None and device_type != torch.autograd.DeviceType.CPU


_active: RankProfiler | None = None


def apply_profile_op(op: tuple[Any, ...], rank: int) -> dict[str, Any] | None:
    """("profile", "start", out_dir) or ("profile", "stop"); returns the summary at stop."""
    global _active
    if op[1] == "start":
        if _active is None:
            _active = RankProfiler(op[2], rank)
        return None
    if _active is None:
        return None
    prof, _active = _active, None
    return prof.stop()


def active_profiler() -> RankProfiler | None:
    return _active
