"""Triton kernels tested in Triton's interpreter on the CPU (TRITON_INTERPRET=1, numpy), so CI checks their
indexing and arithmetic without a GPU. Triton reads that switch when it is first imported (its own library
functions, tl.sum among them, are defined then), and other modules import Triton early (xgrammar does), so the
interpreter cases of a test module run in a fresh process with the switch set from its start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreter_cases(test_file: str, passed: int, timeout: float = 900) -> None:
    """Run test_file's "cpu-interpreter" cases in a fresh interpreter process; all `passed` of them must pass."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run itself")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "cpu-interpreter"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(test_file).parent.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0 and f"{passed} passed" in result.stdout, result.stdout[-4000:] + result.stderr[-2000:]


def interpreter_or_cuda(param: str) -> None:
    """Skip a "cpu"/"cuda" case this process cannot run: no Triton, no GPU, or the CPU case outside the interpreter."""
    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if param == "cpu" and not INTERPRETED:
        pytest.skip("runs in its own process (run_interpreter_cases)")


def device_fixture(module: str, cached: str) -> Any:
    """A `device` fixture over "cpu" (Triton's interpreter) and "cuda" for the kernels that module's function `cached`
    (a functools.cache) compiles: the cache is cleared around each case (a kernel built for one device is not the
    other's)."""

    @pytest.fixture(params=["cpu", "cuda"], ids=["cpu-interpreter", "cuda"])
    def device(request: pytest.FixtureRequest) -> Iterator[str]:
        clear = getattr(importlib.import_module(module), cached).cache_clear
        interpreter_or_cuda(request.param)
        clear()
        yield request.param
        clear()  # the next user compiles them for its own device

    return device
