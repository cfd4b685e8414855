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
# The only pytest plugins the interpreter process loads (those pyproject.toml's options are for): loading every
# installed one (LangSmith's, Hypothesis', ...) took ~6 s of each such process's start.
PLUGINS = ["-p", "pytest_timeout", "-p", "pytest_asyncio.plugin"]


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for the interpreter at each launch (restoring it when the grid
    has run) and again, never restoring, at every call of one @triton.jit function from another (tl.max, tl.zeros
    and the kernels' own helpers: thousands per launch), though what it patches depends only on which of tl and
    tl.core the function's module names, and the wrappers it sets behave alike. Those repeats took up to 40% of a
    case's time. Here, inside a launch, a call whose modules that launch has already patched skips the repeat;
    every other call (the launch's own, the first for another module, any outside a launch) patches as Triton
    does, so the kernels run on the same patched language."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, grid = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or grid is None or not hasattr(interpreter, "_LangPatchScope") or hasattr(patch, "skips"):
        return  # another interpreter layout (leave it as it is), or done already
    patched: list[set[int]] = []  # per launch under way: the modules patched since it began
    run_grid = grid.__call__

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_once(fn: Any) -> Any:
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched[-1]:
            return interpreter._LangPatchScope()  # an empty scope: nothing to set, nothing to restore
        scope = patch(fn)
        if patched:
            patched[-1] |= langs
        return scope

    patch_once.skips = True  # type: ignore[attr-defined]
    grid.__call__ = launch
    interpreter._patch_lang = patch_once


if INTERPRETED and importlib.util.find_spec("triton") is not None:
    _patch_the_language_once_per_launch()


def _scalar_arguments_break() -> bool:
    """Whether this Triton's interpreter fails every kernel with a scalar argument under this NumPy: before 3.7 it
    converts them with int() of a one-element array, an error from NumPy 2.4 on (a GPU machine's Triton 3.6 and
    NumPy 2.4 fail each case alike; the kernels themselves build and pass there)."""
    import importlib.metadata

    import numpy as np

    try:
        int(np.array([1]))
    except TypeError:
        major, minor = (int(part) for part in importlib.metadata.version("triton").split(".")[:2])
        return (major, minor) < (3, 7)
    return False


def run_interpreter_cases(test_file: str, passed: int, timeout: float = 900) -> None:
    """Run test_file's "cpu-interpreter" cases in a fresh interpreter process; all `passed` of them must pass."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run itself")
    if _scalar_arguments_break():
        pytest.skip(
            "Triton < 3.7's interpreter passes a kernel's scalar arguments through int() of a one-element array, which "
            "NumPy >= 2.4 refuses (triton-lang/triton#9171); a newer Triton runs these cases"
        )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, test_file, "-k", "cpu-interpreter"],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
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
