"""How many CPU threads a computing process runs by default, and how they wait.

The default is the physical cores this process may use: hyperthreads share a core's vector units, so a second
thread per core adds barriers without adding GEMM throughput. Counted within the CPU affinity mask (taskset,
a container's cpuset) and capped by a cgroup CPU quota (a container's --cpus).

OMP_WAIT_POLICY=PASSIVE (set by `minisgl`'s process entry before torch loads, unless already set): a thread that
reaches the end of a parallel region sleeps instead of spinning. Spinning threads look busy to the kernel's
scheduler, so on a loaded machine the thread the others wait for gets no more CPU than a CPU hog; a sleeping
thread is woken ahead of the hogs. docs/benchmarks.md has the decode figures with and without it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")


def default_threads() -> int:
    """Physical cores in this process's affinity mask, at most the cgroup CPU quota; at least 1."""
    allowed = _allowed_cpus()
    cores = _physical_cores(allowed)
    quota = cgroup_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def set_wait_policy() -> None:
    """Threads that sleep at the end of a parallel region, in this process and the ones it starts (unless the user
    chose a policy). libgomp reads it once, when torch first loads: it must run before that."""
    os.environ.setdefault(*WAIT_POLICY)


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity masks
        return set(range(os.cpu_count() or 1))


def _physical_cores(allowed: set[int]) -> int:
    """Distinct (package, core) pairs among the allowed logical CPUs (Linux sysfs); else psutil's count scaled to the
    allowed share; else the allowed logical CPUs."""
    root = Path("/sys/devices/system/cpu")
    cores = set()
    for cpu in allowed:
        topo = root / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.clear()
            break
    if cores:
        return len(cores)
    try:
        import psutil

        physical, logical = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
    except ImportError:
        physical = logical = None
    if physical and logical:
        return max(1, len(allowed) * physical // logical)
    return len(allowed)


def cgroup_quota() -> int | None:
    """CPUs the cgroup's quota allows (rounded up), or None when there is no quota (cgroup v2, then v1)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else max(1, math.ceil(quota_us / period_us))
