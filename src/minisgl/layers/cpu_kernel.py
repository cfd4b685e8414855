"""The weight-only int8 GEMM of int8_gemm.c, built once per CPU and compiler with the host's C compiler.

Why a kernel of our own: at decode's one to four rows, torch's int8-weight GEMM (aten's `_weight_int8pack_mm`) streams
int8 weights no faster than oneDNN streams fp32 ones, and fbgemm's int8 GEMMs quantize the inputs to 8 bits, which
costs SmolLM2 several points of top-1 agreement (docs/benchmarks.md). int8_gemm.c keeps fp32 inputs, takes one scale
per group of GROUP inputs and reads each block of channels as one sequential stream.

It is compiled for the host CPU (`-march=native`: AVX-512, else AVX2, else plain C, picked by the compiler) into the
cache (`<MINISGL_CACHE_DIR or ~/.cache/minisgl>/kernels`, named by a hash of the source, compiler and CPU flags), and
links the OpenMP runtime torch loaded, so it splits channels over torch's own threads. Where there is no C compiler
or the build or its check fails, `load()` returns None and layers/cpu_quant.py keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minisgl import env

logger = logging.getLogger("minisgl")

SOURCE = Path(__file__).with_name("int8_gemm.c")
GROUP = 32  # inputs per weight scale
MAX_ROWS = 4  # int8_gemm.c's MAX_ROWS
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class Int8Kernel:
    """int8_gemm.c's entry points over torch tensors (checked by the caller: contiguous, CPU, the right dtypes)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack, self._gemm = lib.int8_pack, lib.int8_gemm
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._pack.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
        self._pack.restype = None
        self._gemm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
        self._gemm.restype = ctypes.c_int

    def pack(self, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scales float32 [N, K / GROUP]) in the kernel's layout."""
        n, k = q.shape
        packed_q, packed_s = torch.empty_like(q), torch.empty_like(scales)
        self._pack(q.data_ptr(), scales.data_ptr(), packed_q.data_ptr(), packed_s.data_ptr(), n, k, GROUP)
        return packed_q, packed_s

    def gemm(self, x: torch.Tensor, packed_q: torch.Tensor, packed_s: torch.Tensor) -> torch.Tensor:
        """x float32 [M <= MAX_ROWS, K] times the packed weight: y float32 [M, N]."""
        (m, k), n = x.shape, packed_q.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        if self._gemm(x.data_ptr(), packed_q.data_ptr(), packed_s.data_ptr(), y.data_ptr(), m, n, k, GROUP) != 0:
            raise ValueError(
                f"int8 GEMM shapes out of range: {m} rows (at most {MAX_ROWS}), K={k} (a multiple of {GROUP})"
            )
        return y


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=out.parent, suffix=".so"
    )  # built aside, renamed: a concurrent load sees a whole file
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check(kernel: Int8Kernel) -> bool:
    """The kernel against torch on a small weight, at each row count it takes."""
    gen = torch.Generator().manual_seed(0)
    n, k = 12, GROUP * 3
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // GROUP, generator=gen) + 0.5
    weight = (q.float().view(n, -1, GROUP) * scales[..., None]).view(n, k)
    packed = kernel.pack(q, scales)
    for m in range(1, MAX_ROWS + 1):
        x = torch.randn(m, k, generator=gen)
        if not torch.allclose(kernel.gemm(x, *packed), x @ weight.t(), rtol=1e-4, atol=1e-3):
            return False
    return True


@functools.cache
def load() -> Int8Kernel | None:
    """The built and checked kernel, or None (no compiler, a failed build or check: logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not SOURCE.exists():
        logger.info("int8: no C compiler (cc/gcc, or $CC): torch's int8 kernels")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_flags()]).encode())
        path = env.cache_root() / "kernels" / f"int8_gemm-{digest.hexdigest()[:16]}.so"
        if not path.exists():
            _build(compiler, path)
        kernel = Int8Kernel(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("int8: building %s failed (%s): torch's int8 kernels", SOURCE.name, e)
        return None
    if not _check(kernel):
        logger.warning("int8: %s disagrees with torch on this CPU: torch's int8 kernels", SOURCE.name)
        return None
    return kernel
