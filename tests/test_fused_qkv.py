"""The fused q/k-norm + RoPE + KV-store Triton kernel (layers/fused_qkv.py) against float32 PyTorch math.

On a CUDA machine it runs compiled; on any machine with Triton it also runs in Triton's interpreter
(TRITON_INTERPRET=1, numpy on the CPU), so CI checks the kernel's indexing and arithmetic without a GPU.
Triton reads that switch when it is first imported (its own library functions, tl.sum among them, are
defined then), and other modules import Triton early (xgrammar does): the interpreter cases run in a
fresh process (test_the_kernel_in_triton_interpreter_on_the_cpu), with the switch set from its start.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import device_fixture, run_interpreter_cases


def test_the_kernel_in_triton_interpreter_on_the_cpu():
    run_interpreter_cases(__file__, passed=4, timeout=600)


device = device_fixture("minisgl.layers.fused_qkv", "_kernel")


@pytest.mark.parametrize(
    ("qk_norm", "dtype", "block_tokens"),
    [
        (True, torch.bfloat16, 1),
        (True, torch.bfloat16, 16),
        (False, torch.float16, 1),
        (False, torch.bfloat16, 8),
    ],
    ids=["qk-norm-bf16-1", "qk-norm-bf16-16", "no-norm-fp16-1", "no-norm-bf16-8"],
)
def test_fused_qkv_kernel_matches_float32_math(device, qk_norm, dtype, block_tokens):
    """layers.fused_qkv (norms + RoPE + KV store in one Triton kernel) against float32 PyTorch math."""
    from minisgl.layers import RMSNorm, RotaryEmbedding
    from minisgl.layers.fused_qkv import fused_qkv, usable

    # One program a token at block_tokens 1: 11 tokens keep the interpreter's run short; 37 leave a partial block.
    tokens = 37 if block_tokens > 1 else 11
    heads, kv_heads, dim, slots = 16, 8, 128, 512
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(device, dtype)
    assert device == "cpu" or usable(qkv, dim)
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(device)
    out_loc = torch.randperm(slots, generator=g)[:tokens].to(device)
    rotary = RotaryEmbedding(dim, 4096, 1e6).to(device)
    norms = [RMSNorm(dim, 1e-6).to(device) for _ in range(2)] if qk_norm else [None, None]
    for n in norms:
        if n is not None:
            n.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    k_cache = torch.zeros(slots, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = fused_qkv(
        qkv,
        positions,
        rotary.cos_sin(),
        *(n.weight if n else None for n in norms),
        1e-6,
        k_cache,
        v_cache,
        out_loc,
        heads,
        kv_heads,
        dim,
        block_tokens=block_tokens,
    )  # 37 tokens: blocks of 8 or 16 end in a partial one

    # Reference: float32 throughout.
    x = qkv.float()
    rq, rk, rv = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    rq, rk, rv = rq.view(tokens, heads, dim), rk.view(tokens, kv_heads, dim), rv.view(tokens, kv_heads, dim)
    if qk_norm:
        rq = rq * torch.rsqrt(rq.pow(2).mean(-1, keepdim=True) + 1e-6) * norms[0].weight.float()
        rk = rk * torch.rsqrt(rk.pow(2).mean(-1, keepdim=True) + 1e-6) * norms[1].weight.float()
    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), rope(rq), **tol)
    torch.testing.assert_close(k_cache[out_loc].float(), rope(rk), **tol)
    torch.testing.assert_close(v_cache[out_loc].float(), rv.to(dtype).float(), atol=0, rtol=0)
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[out_loc] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()  # no other slot written


@pytest.mark.parametrize("block_tokens", [1, 8])
def test_fused_qkv_kernel_saturates_and_rounds_into_an_fp8_pool(device, block_tokens):
    """kv_cache_dtype="fp8_e4m3": k and v land in the pool as KVPool.store would put them (saturated to ±448,
    rounded once); q stays in the model's dtype."""
    from minisgl.layers import RotaryEmbedding
    from minisgl.layers.fused_qkv import fused_qkv

    if device == "cpu":  # its fp8 casts carry no rounding into the exponent: -31.625 -> -16, -124 -> -64
        pytest.skip("Triton's interpreter converts to fp8 wrongly; the GPU run checks this kernel")
    tokens, heads, kv_heads, dim, slots = 19, 4, 2, 64, 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 200  # many values past 448
    qkv = x.to(device, torch.bfloat16)
    positions = torch.randint(0, 1000, (tokens,), generator=g).to(device)
    out_loc = torch.randperm(slots, generator=g)[:tokens].to(device)
    rotary = RotaryEmbedding(dim, 1024, 1e4).to(device)
    fp8 = torch.float8_e4m3fn
    k_cache = torch.zeros(slots, kv_heads, dim, device=device, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    fused_qkv(
        qkv,
        positions,
        rotary.cos_sin(),
        None,
        None,
        0.0,
        k_cache,
        v_cache,
        out_loc,
        heads,
        kv_heads,
        dim,
        block_tokens=block_tokens,
    )  # 19 tokens: blocks of 8 end in a partial one

    f = qkv.float()
    rk = f[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    rv = f[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)
    k1, k2 = rk.chunk(2, dim=-1)
    rk = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    assert (rv.abs() > 448).any() and (rk.abs() > 448).any()
    want_v = rv.clamp(-448, 448).to(fp8).float()
    got_v = v_cache.view(torch.uint8)[out_loc].view(fp8).float()
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)  # a copy: saturated, then rounded to nearest even
    want_k = rk.clamp(-448, 448).to(fp8).float()
    got_k = k_cache.view(torch.uint8)[out_loc].view(fp8).float()
    torch.testing.assert_close(got_k, want_k, atol=1e-3, rtol=0.13)  # RoPE in float32: at most one fp8 step apart
