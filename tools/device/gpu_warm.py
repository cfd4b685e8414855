"""Build every flashinfer JIT module minisgl uses, in parallel (a fresh install has none built).

    python3 tools/device/gpu_warm.py [--fa3]

Each build is triggered by a tiny call from its own thread; ninja runs outside the GIL, so the
builds overlap. The cache lands in ~/.cache/flashinfer (FLASHINFER_WORKSPACE_BASE); tools/device/gpu_check.sh
packs it as OUT_DIR/fi_aot.tar.gz, which tools/device/env.sh restores on another machine (FLASHINFER_AOT).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def norm() -> None:
    import flashinfer

    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    flashinfer.norm.rmsnorm(x, w)
    flashinfer.norm.fused_add_rmsnorm(x, x.clone(), w)
    flashinfer.norm.rmsnorm(torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda"), w[:128])


def activation() -> None:
    import flashinfer

    flashinfer.activation.silu_and_mul(torch.randn(4, 256, dtype=torch.bfloat16, device="cuda"))


def rope() -> None:
    import flashinfer

    q = torch.randn(4, 16, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.randn(64, 128, dtype=torch.float32, device="cuda")
    pos = torch.arange(4, device="cuda")
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 128, cache, is_neox=True)


def sampling() -> None:
    import flashinfer

    logits = torch.randn(4, 1000, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    flashinfer.sampling.sampling_from_logits(logits, generator=g)
    flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, 5, 0.9, filter_apply_order="top_k_first", generator=g)


def attention(backend: str, tensor_cores: bool = True) -> None:
    import flashinfer

    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    kv = torch.randn(2, 64, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    indptr = torch.tensor([0, 16], dtype=torch.int32)
    indices = torch.arange(16, dtype=torch.int32, device="cuda")
    last = torch.tensor([1], dtype=torch.int32)
    if backend == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(indptr, indices, last, 16, 8, 128, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        w.run(torch.randn(1, 16, 128, dtype=torch.bfloat16, device="cuda"), (kv[0], kv[1]))
        return
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    qo = torch.tensor([0, 4], dtype=torch.int32)
    w.plan(
        qo, indptr, indices, last, 16, 8, 128, 1, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16
    )
    w.run(torch.randn(4, 16, 128, dtype=torch.bfloat16, device="cuda"), (kv[0], kv[1]))


def xqa(kv_dtype: torch.dtype, page_size: int = 16) -> None:
    """XQA's decode module for the Qwen3-0.6B shape (attention/xqa.py builds it on first use)."""
    if torch.cuda.get_device_capability()[0] != 9:
        return
    from flashinfer.xqa import get_xqa_module

    get_xqa_module(torch.bfloat16, kv_dtype, page_size, 128, 2, False, torch.bfloat16)


def main() -> None:
    jobs = {
        "norm": norm,
        "activation": activation,
        "rope": rope,
        "sampling": sampling,
        "decode+fa2": lambda: attention("decode"),
        "decode (CUDA cores)": lambda: attention("decode", tensor_cores=False),
        "xqa fp8": lambda: xqa(torch.float8_e4m3fn),
        "xqa bf16": lambda: xqa(torch.bfloat16),
    }
    if "--fa3" in sys.argv:
        jobs["fa3"] = lambda: attention("fa3")
    t0 = time.perf_counter()
    failed = False
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(fn) for name, fn in jobs.items()}
        for name, fut in futures.items():
            try:
                fut.result()
                print(f"jit {name}: ok ({time.perf_counter() - t0:.0f}s)", flush=True)
            except Exception as e:  # noqa: BLE001 - report every module, fail at the end
                failed = True
                print(f"jit {name}: FAILED {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize()
    print(f"flashinfer JIT warm-up {time.perf_counter() - t0:.0f}s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
