"""minisgl's Triton kernels compiled for NVIDIA GPUs on any machine: Triton's compiler and the ptxas it
ships build each kernel for Hopper (sm_90, with programmatic dependent launch) and Ampere (sm_80, without), no GPU
needed.

The interpreter tests check the kernels' arithmetic on the CPU, but never take the paths that only a GPU has: PDL's
grid-dependency controls, inline PTX (the sampling's lg2.approx), an fp8 KV cache's conversions, and Triton's code
generator and ptxas at the tilings tune may pick. Each case is a combination of constexprs that a launcher passes;
the argument types are those of the launchers' tensors (bf16 activations and weights, float32 and int64 where the
launchers use them).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
    pytest.skip("needs Triton with its NVIDIA backend", allow_module_level=True)

HOPPER, AMPERE = 90, 80
GEMV_FLAGS = {  # NORM, ADD, GATED, HAS_BIAS: a plain linear, with its bias, after a fused add + norm, gated
    "plain": (False, False, False, False),
    "bias": (False, False, False, True),
    "add-norm": (True, True, False, False),
    "add-norm-gated": (True, True, True, False),
    "norm-gated": (True, False, True, False),
}


def _gemv(flags: str, rows: int, config: tuple) -> dict[str, Any]:
    norm, add, gated, bias = GEMV_FLAGS[flags]
    block_n, block_k, warps, *defer = config
    consts = dict(K=1024, NORM=norm, ADD=add, GATED=gated, HAS_BIAS=bias, BLOCK_N=block_n, BLOCK_K=block_k)
    if rows > 1:
        consts.update(ROWS=rows, DEFER=bool(defer and defer[0]))
    return dict(kernel="gemv_kernel" if rows == 1 else "gemv_rows_kernel", consts=consts, warps=warps)


def _gemv_cases() -> list[Any]:
    from minisgl.layers import gemv

    cases = [pytest.param(_gemv(f, 1, gemv.CONFIGS[0]), id=f"gemv-1-{f}") for f in GEMV_FLAGS]
    for rows in gemv.ROW_BUCKETS[1:]:  # the first tiling of each kind that tune tries at rows
        configs = gemv.configs_for(rows)
        configs = [configs[0]] + [c for c in configs if len(c) > 3][:1]
        cases += [pytest.param(_gemv(f, rows, c), id=f"gemv-{rows}-{f}-{c}") for f in GEMV_FLAGS for c in configs]
    return cases


QKV_TYPES = {"pos_ptr": "*i64", "loc_ptr": "*i64", "cos_sin_ptr": "*fp32"}
GUMBEL_TYPES = {
    "temp_ptr": "*fp32",
    "step_ptr": "*i64",
    "seed": "i64",
    "best_val_ptr": "*fp32",
    "best_idx_ptr": "*i32",
    "out_ptr": "*i64",
}
MOE = dict(TOP_K=8, RENORM=True, BLOCK_E=128, BLOCK_TOP=8)
QKV = dict(H=16, HKV=8, D=128)
E4M3_CACHE = {**QKV_TYPES, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
E5M2_CACHE = {**QKV_TYPES, "k_cache_ptr": "*fp8e5", "v_cache_ptr": "*fp8e5"}


MODULES = {  # the module of each kernel defined at its top level
    "gemv_kernel": "minisgl.layers.gemv_kernel",
    "gemv_rows_kernel": "minisgl.layers.gemv_kernel",
    "qkv_kernel": "minisgl.layers.fused_qkv_kernel",
    "moe_up_kernel": "minisgl.layers.moe_gemv_kernel",
    "moe_down_kernel": "minisgl.layers.moe_gemv_kernel",
    "route_kernel": "minisgl.layers.moe_gemv_kernel",
    "reduce_norm_kernel": "minisgl.distributed.reduce_norm_kernel",
    "reduce_norm_ll_kernel": "minisgl.distributed.reduce_norm_kernel",
}


def _case(name: str, kernel: str, consts: dict, warps: int = 4, types: dict | None = None, stages: int = 3) -> Any:
    return pytest.param(dict(kernel=kernel, consts=consts, warps=warps, types=types, stages=stages), id=name)


IDS_TYPES = {f"{name}_ptr": "*i32" for name in ("ids", "counts", "cursor", "block_expert", "total", "sorted_ids")}
IDS_TYPES["scratch_ptr"] = "*i32"
PER_EXPERT = dict(BLOCK_SIZE_M=32, BLOCK_P=2048, BLOCK_E=128, BLOCK_B=64)  # align_by_expert's one-launch path
REDUCE_TYPES = {"bufs_ptr": "*i64", "flags_ptr": "*i64"}  # the ranks' buffers' and flags' addresses
REDUCE_LL_TYPES = {"inbox_ptrs": "*i64"}
MOE_GEMM_TYPES = {"weights_ptr": "*fp32", "b_scale_ptr": "*fp32"}
MOE_GEMM_TYPES.update({f"{name}_ptr": "*i32" for name in ("sorted_ids", "block_expert", "total")})


def _moe_gemm_cases() -> list[Any]:
    """fused_moe's grouped GEMM at the smallest and the largest tiling block_config picks: the gate-up GEMM (rows of
    x read top_k times; SiLU-and-mul in it where gated_config says) and the down GEMM (times the routing weights)."""
    from minisgl.layers.fused_moe import block_config, gated_config

    cases = []
    for tokens in (16, 16384):  # Qwen3-30B-A3B's 128 experts, top-8: decode's smallest tiles and the prefill's
        config = block_config(tokens, 8, 128)
        for step, row_div, weighted, tiles in (
            ("gate-up", 8, False, gated_config(config, False)),
            ("down", 1, True, None),
        ):
            tiles = tiles or config
            gated = tiles is not config
            tiling = {key: tiles[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
            consts = dict(
                A_ROW_DIV=row_div, MUL_WEIGHT=weighted, B_SCALED=False, GATED=gated, PRECISION="tf32", **tiling
            )
            name = f"moe-gemm-{step}-{tiles['BLOCK_M']}x{tiles['BLOCK_N']}"
            cases.append(
                _case(name, "moe_gemm_kernel", consts, tiles["num_warps"], MOE_GEMM_TYPES, tiles["num_stages"])
            )
    fp8 = dict(cases[-1].values[0], types={**MOE_GEMM_TYPES, "b_ptr": "*fp8e4nv"})  # FP8 experts, per-channel scales
    fp8["consts"] = dict(fp8["consts"], B_SCALED=True)
    return cases + [pytest.param(fp8, id="fp8-moe-gemm-down")]


FP8_TYPES = {"b_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "a_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv"}


def _fp8_cases() -> list[Any]:
    """layers/fp8_gemm.py's kernels (Hopper only: the FP8 GEMMs run from compute capability 9.0): the weight-only GEMV
    and tensor-core kernel, the FP8 x FP8 kernel at its smallest and largest tiles, the norm that quantizes for it."""
    from minisgl.layers import fp8_gemm

    cases = []
    for gate_up in (False, True):
        gemv = {**fp8_gemm.gemv_config(4096, 4096), "ROWS": 1}
        cases.append(_fp8("gemv", dict(gemv, GATE_UP=gate_up)))
        cases.append(_fp8("w8a16", dict(fp8_gemm.W8A16_CONFIG, GATE_UP=gate_up)))
        cases += [_fp8("w8a8", dict(fp8_gemm.w8a8_config(m, gate_up), GATE_UP=gate_up)) for m in (16, 128)]
    for quant, early in ((True, False), (False, True)):
        cases.append(_fp8("add_rmsnorm", dict(FP8_MAX=448.0, QUANT=quant, EARLY=early, BLOCK=4096, num_warps=8)))
    return cases + [_fp8("quant_rows", dict(FP8_MAX=448.0, BLOCK=4096, num_warps=4))]


def _fp8(kernel: str, config: dict) -> Any:
    config = dict(config)
    warps, stages = config.pop("num_warps"), config.pop("num_stages", 3)
    name = f"fp8-{kernel}-" + "-".join(f"{key}{value}" for key, value in config.items() if key != "FP8_MAX")
    types = {**FP8_TYPES, "a_ptr": "*fp8e4nv"} if kernel == "w8a8" else FP8_TYPES  # x quantized too
    return _case(name, f"fp8:{kernel}", config, warps, types, stages)


OTHER_CASES = [
    *(
        _case(f"qkv-tb{tb}-norm-{norm}", "qkv_kernel", dict(HAS_NORM=norm, KV_MAX=0.0, TB=tb, **QKV), w, QKV_TYPES)
        for tb, w in ((1, 1), (8, 4))
        for norm in (True, False)
    ),
    _case("qkv-e5m2-cache", "qkv_kernel", dict(HAS_NORM=True, KV_MAX=57344.0, TB=8, **QKV), 4, E5M2_CACHE),
    *(
        _case(f"gumbel-draw-{n}-shards", "gumbel_draw_kernel", dict(SHARDS=n, BLOCK=1024, FAST=True), 4, GUMBEL_TYPES)
        for n in (1, 2)
    ),
    *(
        _case(f"gumbel-reduce-{n}-shards", "gumbel_reduce_kernel", dict(SHARDS=n, S=32), 4, GUMBEL_TYPES)
        for n in (1, 2)
    ),
    _case("moe-up", "moe_up_kernel", dict(K=2048, BLOCK_N=2, BLOCK_K=1024, **MOE)),
    _case("moe-down", "moe_down_kernel", dict(K=768, BLOCK_N=2, BLOCK_K=256, **MOE)),
    _case("moe-route", "route_kernel", MOE, types={"weights_ptr": "*fp32", "ids_ptr": "*i32"}),
    *_moe_gemm_cases(),
    _case("moe-count", "moe_count_kernel", dict(BLOCK=1024), types=IDS_TYPES),
    _case("moe-layout", "moe_layout_kernel", dict(BLOCK_SIZE_M=16, BLOCK_E=128, BLOCK_B=64), types=IDS_TYPES),
    _case("moe-scatter", "moe_scatter_kernel", dict(BLOCK=1024), types=IDS_TYPES),
    _case("moe-per-expert", "moe_per_expert_kernel", PER_EXPERT, 4, IDS_TYPES),
    _case("moe-combine", "moe_combine_kernel", dict(TOP_K=8, BLOCK_H=1024), types={"ids_ptr": "*i32"}),
    *_fp8_cases(),
    *(
        _case(
            f"reduce-norm-{world}-ranks", "reduce_norm_kernel", dict(H=5120, BLOCK=8192, WORLD=world), 8, REDUCE_TYPES
        )
        for world in (1, 2)
    ),
    _case("reduce-norm-ll-2-ranks", "reduce_norm_ll_kernel", dict(H=5120, BLOCK=8192, WORLD=2), 8, REDUCE_LL_TYPES),
]


# Kernels that their modules build on first use (Triton imported lazily): (module, factory, index in what it returns).
BUILT = {
    "moe_gemm_kernel": ("minisgl.layers.fused_moe", "_gemm_kernel", None),
    "moe_count_kernel": ("minisgl.layers.fused_moe", "_grouping_kernels", 0),
    "moe_layout_kernel": ("minisgl.layers.fused_moe", "_grouping_kernels", 1),
    "moe_scatter_kernel": ("minisgl.layers.fused_moe", "_grouping_kernels", 2),
    "moe_per_expert_kernel": ("minisgl.layers.fused_moe", "_grouping_kernels", 3),
    "moe_combine_kernel": ("minisgl.layers.fused_moe", "_combine_kernel", None),
    "gumbel_draw_kernel": ("minisgl.engine.gumbel", "_kernels", 0),
    "gumbel_reduce_kernel": ("minisgl.engine.gumbel", "_kernels", 1),
}


def _kernel(name: str) -> Any:
    if name.startswith("fp8:"):
        return importlib.import_module("minisgl.layers.fp8_gemm")._kernels()[name[4:]]
    if name in BUILT:
        module, factory, index = BUILT[name]
        built = getattr(importlib.import_module(module), factory)()
        return built if index is None else built[index]
    return getattr(importlib.import_module(MODULES[name]), name)


def compile_for(
    arch: int,
    kernel: str,
    consts: dict,
    warps: int,
    types: dict | None = None,
    stages: int = 3,
    aligned: bool = False,
) -> Any:
    """kernel compiled for sm_<arch> with consts (and PDL where it takes it: on from Hopper): pointers are
    bf16 and scalars int32 unless types says otherwise (eps: float32). aligned: the pointer arguments 16-byte
    aligned, as Triton's launcher finds torch's tensors (it specializes on that)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel(kernel)
    consts = dict(consts)
    if "PDL" in fn.arg_names:
        consts["PDL"] = arch >= HOPPER
    types = {"eps": "fp32", **(types or {})}
    signature = {
        name: "constexpr" if name in consts else types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
        for name in fn.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if aligned and name.endswith("_ptr")
    }
    source = ASTSource(fn, signature, consts, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _builds() -> list[Any]:
    """(case, arch) for every case on Hopper, and on Ampere those that run there (not the FP8 GEMMs nor KV stores)."""
    return [
        pytest.param(case.values[0], arch, id=f"{case.id}-sm{arch}")
        for case in _gemv_cases() + OTHER_CASES
        for arch in (HOPPER, AMPERE)
        # FP8 GEMMs from compute capability 9.0 (supported()), FP8 KV stores from 8.9 (fused_qkv.stores_into)
        if arch >= HOPPER or not (case.id.startswith("fp8-") or case.id == "qkv-e5m2-cache")
    ]


@pytest.mark.parametrize("case, arch", _builds())
def test_the_kernel_compiles_for_the_gpu(case, arch):
    compiled = compile_for(arch, **case)
    assert compiled.asm["cubin"]  # ptxas built it for the target
    assert f"sm_{arch}" in compiled.asm["ptx"]


def test_the_pdl_controls_are_in_the_hopper_build_only():
    """With PDL the kernel waits on the previous grid (griddepcontrol) before its first load; without, no such
    instruction, so an Ampere build runs as before."""
    case = _gemv("add-norm", 4, (2, 512, 4, True))
    assert "griddepcontrol.wait" in compile_for(HOPPER, **case).asm["ptx"]
    assert "griddepcontrol" not in compile_for(AMPERE, **case).asm["ptx"]


def test_the_fused_all_reduce_reads_the_ranks_partial_sums_16_bytes_at_a_time():
    """Its partial sums' addresses come from memory (the peers' symmetric-memory mappings), whose alignment Triton
    cannot see: without its hint every thread would read them 2 bytes at a time (over NVLink, for the peers')."""
    for kernel, types in (("reduce_norm_kernel", REDUCE_TYPES), ("reduce_norm_ll_kernel", REDUCE_LL_TYPES)):
        case = dict(kernel=kernel, consts=dict(H=5120, BLOCK=8192, WORLD=2), warps=8, types=types)
        ptx = compile_for(HOPPER, **case, aligned=True).asm["ptx"]
        assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx and "st.global.b16" not in ptx, kernel


def test_an_fp8_kv_pool_is_stored_by_the_fused_kernel_only_from_compute_capability_8_9():
    """Triton has float8_e4m3fn from compute capability 8.9: on an A100 (8.0) the kernel does not build for that pool
    (nor, with some Triton versions, for e5m2), and fused_qkv.stores_into sends its stores down the unfused path."""
    import torch

    from minisgl.layers.fused_qkv import stores_into

    case = dict(kernel="qkv_kernel", consts=dict(HAS_NORM=True, KV_MAX=448.0, TB=8, **QKV), warps=4, types=E4M3_CACHE)
    assert compile_for(HOPPER, **case).asm["cubin"] and stores_into(torch.float8_e4m3fn, (9, 0))
    with pytest.raises(Exception, match="fp8e4nv"):
        compile_for(AMPERE, **case)
    assert not stores_into(torch.float8_e4m3fn, (8, 0)) and not stores_into(torch.float8_e5m2, (8, 0))
    assert stores_into(torch.float8_e5m2, (9, 0)) and stores_into(torch.bfloat16, (8, 0))


def test_every_kernel_of_the_kernel_modules_has_a_case():
    """A kernel added to one of these modules gets a case above (the factories' kernels are listed in BUILT)."""
    import triton

    compiled = {id(_kernel(param.values[0]["kernel"])) for param in _gemv_cases() + OTHER_CASES}
    for module in ("layers.gemv_kernel", "layers.fused_qkv_kernel", "layers.moe_gemv_kernel", "layers.fp8_gemm_kernels",
                   "distributed.reduce_norm_kernel"):  # fmt: skip
        mod = importlib.import_module(f"minisgl.{module}")
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                assert id(fn) in compiled, f"{module}.py: {name} has no case in {__name__}"
