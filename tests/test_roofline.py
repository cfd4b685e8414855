"""bench/roofline.py: kernel classes by name, and the bytes and FLOPs of a decode step checked against HF models
of the same shape (their parameters and KV cache counted, not computed from the formula)."""

from __future__ import annotations

import pytest
import torch

from minisgl.bench.roofline import OTHER, kernel_class, step_costs
from minisgl.bench.throughput import QWEN3_06B, QWEN3_30B_A3B


@pytest.mark.parametrize(
    "name, cls",
    [
        ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
        ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
        ("fused_moe_kernel", "moe experts"),
        ("gemm_kernel", "moe experts"),  # layers/fused_moe.py's grouped GEMM (Triton)
        ("route_kernel", "moe experts"),
        ("gemv_kernel", "gemm"),  # layers/gemv.py's one-row GEMV (Triton), its norm and SiLU-and-mul fused or not
        ("qkv_kernel", "rope"),  # layers/fused_qkv.py: q/k norms, RoPE and the KV store (Triton)
        ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>", "norm"),
        ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<...>", "rope"),
        ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>", "activation"),
        ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<...>", "sampling"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
        ("void at::native::index_copy_kernel_impl<...>", "kv store, copies"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", OTHER),
    ],
)
def test_kernels_are_classed_by_name(name, cls):
    assert kernel_class(name) == cls


def test_minisgl_triton_kernels_are_classed_by_what_they_do():
    """The profile sees a Triton kernel by its function's name: each of minisgl's own lands in its class (a generic
    name such as `_draw_kernel` would fall into "other")."""
    pytest.importorskip("triton")
    from minisgl.distributed import reduce_norm
    from minisgl.engine import gumbel
    from minisgl.layers import fp8_gemm, fused_moe, fused_qkv, gemv, moe_gemv

    fp8 = fp8_gemm._kernels()
    expected = {
        "sampling": [*gumbel._kernels()],
        "gemm": [fp8["w8a16"], fp8["w8a8"], fp8["gemv"], gemv._kernel()],
        "norm": [fp8["add_rmsnorm"], *reduce_norm._kernels()],
        "rope": [fused_qkv._kernel()],
        "moe experts": [
            fused_moe._route_kernel(),
            fused_moe._gemm_kernel(),
            *fused_moe._grouping_kernels(),
            fused_moe._combine_kernel(),
            *moe_gemv._kernels(),
        ],
    }
    for cls, kernels in expected.items():
        for kernel in kernels:
            assert kernel_class(kernel.fn.__name__) == cls, kernel.fn.__name__


def _small(shape: dict, **overrides) -> dict:
    return dict(
        shape,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
        **overrides,
    )


def _hf_model(c: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items() if k != "model_type"})
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def test_dense_step_reads_every_linear_weight_and_the_kv_of_its_tokens():
    c = _small(QWEN3_06B)
    hf = _hf_model(c)
    linear_params = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    batch, tokens = 3, 40
    costs = step_costs(c, batch=batch, kv_tokens=tokens)
    weight_bytes = 2 * linear_params
    assert weight_bytes < costs["gemm"][0] < weight_bytes * 1.5  # the weights, plus this small model's activations
    assert costs["gemm"][1] == 2 * batch * linear_params
    with torch.no_grad():  # the KV of 400 tokens, as HF's cache holds it in bf16
        cache = hf(torch.zeros(1, 400, dtype=torch.long), use_cache=True).past_key_values
    kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes <= step_costs(c, batch=1, kv_tokens=400)["attention"][0] < kv_bytes * 1.02  # + the q and o rows


def test_moe_step_reads_the_experts_a_large_batch_touches():
    c = _small(QWEN3_30B_A3B, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    hf = _hf_model(c)
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    routers = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight"))
    costs = step_costs(c, batch=10_000, kv_tokens=0)  # every expert of every layer is routed to
    assert costs["moe experts"][0] == pytest.approx(2 * experts, rel=1e-6)
    one_row = step_costs(c, batch=1, kv_tokens=0)["moe experts"][0]
    assert one_row == pytest.approx(2 * experts * 2 / 8, rel=1e-6)  # top-2 of 8 experts per layer
    dense = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear)) - routers
    assert 2 * (dense + routers) <= costs["gemm"][0]


@pytest.mark.parametrize("shape", [QWEN3_06B, QWEN3_30B_A3B], ids=["dense", "moe"])
def test_step_floors_over_the_workload_add_up_to_the_throughput_floor(shape):
    """bench profile's per-step floors (roofline.step_floor) summed over the workload's decode steps against bench
    throughput's floor: two separate computations of the same bytes, apart only by what the roofline adds (the
    rows' activations and logits, the attention's q and o rows) and the norms it leaves out."""
    from minisgl.bench.roofline import step_floor
    from minisgl.bench.throughput import bandwidth_floor, workload

    bandwidth = 4e12
    prompts, max_tokens = workload()
    total = 0.0
    for j in range(max(max_tokens) - 1):  # decode step j + 1 of a request reads its prompt's KV and j + 1 tokens more
        running = [len(p) + j + 1 for p, o in zip(prompts, max_tokens) if o - 1 > j]
        total += step_floor(shape, len(running), sum(running), bandwidth)
    floor = bandwidth_floor(bandwidth, shape)["floor_seconds"]
    assert floor < total < floor * 1.03
