"""The fused mixture-of-experts path of layers/moe.py on a GPU, in Triton.

Per layer: one kernel routes (softmax over the experts, top-k, optional renormalisation); the (token, slot)
pairs are grouped by expert on the GPU, each expert's group padded to a multiple of the GEMM's BLOCK_M
(`align_by_expert`: no host sync, static shapes, so a decode step replays from a CUDA graph); a grouped GEMM
computes every pair's gate_up row, SiLU-and-mul halves it (in the GEMM's epilogue where that measures faster:
`gated_config`), a second grouped GEMM computes the down projection scaled by the pair's routing weight, and the
top_k rows of each token are summed (`topk_sum`). On Hopper and later the routing, the one-launch grouping, both GEMMs
and the sum launch with programmatic dependent launch (layers/fused.py: pdl_args): each waits for the kernel before
it at its first instruction, so its launch overlaps that kernel's tail (the offline workload on the Qwen3-30B-A3B
shape 1.005-1.008x, docs/benchmarks.md).

The grouped GEMM is the design of vLLM's / SGLang's fused_moe_kernel: a program owns BLOCK_M rows of one
expert's group and BLOCK_N output features; blocks past the padded total exit at once. Its block sizes follow
the expected rows per expert (tokens * top_k / experts): small for decode, where the layer reads nearly every
expert's weights and is bound by memory, larger for prefill. FP8 experts (layers/fp8_gemm.py's format: e4m3 with
one scale per output channel) take the same kernel: each weight tile is widened to the activations' dtype in
registers and the scales multiply the sums, so decode reads half the bytes and the activations stay unquantized.

Under expert parallelism (layers/moe.py, moe_parallel="ep") a rank holds only the experts [expert_offset,
expert_offset + E_local): routing still takes the top_k of all E router logits, the grouping drops the pairs
routed to other ranks' experts (no GEMM computes them) and lays out the local experts only; the top-k sum visits
only the local pairs' rows (`_combine_kernel`), so the dropped rows, never written, add nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minisgl.layers import moe_gemv
from minisgl.layers.activation import SiluAndMul
from minisgl.layers.fused import gdc, pdl_args

# The kernels' PDL controls (layers/fused.py: gdc), which Triton finds among this module's globals; bound by the
# kernel factories below on first use, so that importing this module does not import Triton.
gdc_wait = gdc_launch_dependents = None


def _bind_pdl_controls() -> None:
    global gdc_wait, gdc_launch_dependents
    gdc_wait, gdc_launch_dependents = gdc()


@functools.cache
def _route_kernel() -> Any:
    from minisgl.layers.moe_gemv_kernel import route_kernel  # lazy: triton is GPU-only

    return route_kernel


@functools.cache
def _gemm_kernel() -> Any:
    _bind_pdl_controls()
    import triton  # lazy: triton is GPU-only
    import triton.language as tl  # lazy: triton is GPU-only

    # The batch's sizes are not specialised on (Triton would compile again for a count that is or is not a multiple
    # of 16, ~1 s in the middle of serving): one compiled kernel per block configuration.
    @triton.jit(do_not_specialize=["num_pairs", "num_rows_padded"])
    def gemm_kernel(
        a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, b_scale_ptr,
        N, K, num_pairs, num_rows_padded, stride_am, stride_be, stride_bn, stride_cm, stride_se,
        A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr, GATED: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # c[pair] = a[pair // A_ROW_DIV] @ b[expert]^T (* weights[pair]) for the pairs of each row block; FP8 b
        # (B_SCALED) is widened to a's dtype tile by tile and its per-channel scales applied to the sums. GATED: b
        # holds 2N rows [gate | up] and c[pair] = silu(gate sum) * up sum, each sum rounded to c's dtype first (as
        # the unfused GEMM and SiLU-and-mul computed it).
        if PDL:  # launched early (programmatic dependent launch): the previous kernel's writes are visible from here
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(num_rows_padded, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
        pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
        up_ptrs = b_ptrs + N * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION)
            if GATED:
                up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                acc_up += tl.dot(a, up.to(a.dtype), input_precision=PRECISION)
                up_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if B_SCALED:
            acc = acc * tl.load(b_scale_ptr + expert * stride_se + offs_n)[None, :]
            if GATED:
                acc_up = acc_up * tl.load(b_scale_ptr + expert * stride_se + N + offs_n)[None, :]
        if GATED:  # fp8_gemm_kernels.silu_and_mul (the interpreter does not resolve a factory's imports)
            gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + out_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (out_n[None, :] < N))

    return gemm_kernel


@functools.cache
def _grouping_kernels() -> tuple[Any, Any, Any, Any]:
    _bind_pdl_controls()
    import triton  # lazy: triton is GPU-only
    import triton.language as tl  # lazy: triton is GPU-only

    @triton.jit(do_not_specialize=["num_pairs"])  # as gemm_kernel: one compiled kernel for every batch
    def count_kernel(ids_ptr, counts_ptr, num_pairs, expert_offset, num_local, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0) - expert_offset
        mask = (offs < num_pairs) & (expert >= 0) & (expert < num_local)  # pairs of other ranks' experts drop out
        tl.atomic_add(counts_ptr + tl.where(mask, expert, 0), 1, mask=mask)

    @triton.jit(do_not_specialize=["num_blocks"])
    def layout_kernel(
        counts_ptr, cursor_ptr, block_expert_ptr, total_ptr, num_experts, num_blocks,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        # One program: each expert's padded run of rows, its start (the scatter's cursor), every row block's expert.
        experts = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        padded = (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M
        ends = tl.cumsum(padded, axis=0)
        tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
        tl.store(total_ptr, tl.sum(padded, axis=0))
        ends = tl.where(experts < num_experts, ends, 1 << 30)
        for first in range(0, num_blocks, BLOCK_B):
            blocks = first + tl.arange(0, BLOCK_B)
            expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_SIZE_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < num_blocks)

    @triton.jit(do_not_specialize=["num_pairs"])
    def scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, num_pairs, expert_offset, num_local, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0) - expert_offset
        mask = (offs < num_pairs) & (expert >= 0) & (expert < num_local)
        row = tl.atomic_add(cursor_ptr + tl.where(mask, expert, 0), 1, mask=mask)
        tl.store(sorted_ids_ptr + tl.where(mask, row, 0), offs, mask=mask)

    @triton.jit(do_not_specialize=["num_pairs", "num_rows"])
    def per_expert_kernel(
        ids_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr, num_pairs, expert_offset, num_local, num_rows,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # Program e lays out local expert e's run of rows, none waiting for another: each counts every expert (a
        # histogram of the pairs; those of other ranks' experts and the lanes past num_pairs fall in bin BLOCK_E,
        # past the experts), so it knows where its padded run starts; its pairs keep their order (a cumsum), the
        # rest of the run is padding, and its row blocks name it. Program 0 writes the padded total; the rows past
        # it are padding too, each program filling every num_local-th block of BLOCK_B of them.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        e = tl.program_id(0)
        offs = tl.arange(0, BLOCK_P)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0) - expert_offset
        local = (offs < num_pairs) & (expert >= 0) & (expert < num_local)
        bins = tl.arange(0, 2 * BLOCK_E)
        counts = tl.histogram(tl.where(local, expert, BLOCK_E), 2 * BLOCK_E)
        padded = tl.where(bins < num_local, (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M, 0)
        start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
        count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
        run = (count + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M
        mine = local & (expert == e)
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(sorted_ids_ptr + start + rank, offs, mask=mine)
        pad = count + tl.arange(0, BLOCK_SIZE_M)
        tl.store(sorted_ids_ptr + start + pad, num_pairs, mask=pad < run)
        for first in range(0, run // BLOCK_SIZE_M, BLOCK_B):
            blocks = first + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + start // BLOCK_SIZE_M + blocks, e, mask=blocks < run // BLOCK_SIZE_M)
        total = tl.sum(padded, axis=0)
        if e == 0:
            tl.store(total_ptr, total)
        for first in range(total + e * BLOCK_B, num_rows, num_local * BLOCK_B):
            rows = first + tl.arange(0, BLOCK_B)
            tl.store(sorted_ids_ptr + rows, num_pairs, mask=rows < num_rows)

    return count_kernel, layout_kernel, scatter_kernel, per_expert_kernel


@functools.cache
def _combine_kernel() -> Any:
    """The top-k sum (`topk_sum`): it reads only the rows of the pairs of local experts (all of them without expert
    parallelism)."""
    _bind_pdl_controls()
    import triton  # lazy: triton is GPU-only
    import triton.language as tl  # lazy: triton is GPU-only

    @triton.jit
    def combine_kernel(
        down_ptr, ids_ptr, out_ptr, hidden, expert_offset, num_local, stride_out, TOP_K: tl.constexpr,
        BLOCK_H: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # out[t] = the sum of the down rows of token t's pairs whose expert is local; the others' rows are not read.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        token = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pair = token * TOP_K + k
            expert = tl.load(ids_ptr + pair) - expert_offset
            width = tl.where((expert >= 0) & (expert < num_local), hidden, 0)  # a pair of another rank: none
            row = tl.load(down_ptr + pair.to(tl.int64) * hidden + offs, mask=offs < width, other=0.0)
            acc += row.to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < hidden)

    return combine_kernel


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int32): layers/moe.py's route() in one kernel."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        block_e, block_top = moe_gemv.routing_blocks(num_experts, top_k)
        args = (router_logits, weights, ids, num_experts, router_logits.stride(0), top_k, renormalize, block_e)
        _route_kernel()[(tokens,)](*args, block_top, **pdl_args(router_logits.device))
    return weights, ids


# Up to this many (token, slot) pairs (a decode step of 256 tokens at top-8) a program per expert groups them: one
# launch instead of five (two fills, count, layout, scatter) in every MoE layer of a decode graph. On an H200 at
# Qwen3-30B-A3B's experts it takes 2.2-4.7 us from 1 to 236 tokens, where one program with atomics took 2.6-8.3.
ONE_LAUNCH_PAIRS = 2048


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each group padded to a multiple of block_m, on the device.

    The experts are the num_experts local ones from expert_offset on (all of them without expert parallelism);
    pairs whose expert is outside that range are left out. Returns sorted_ids [R] (pair index token * top_k + slot,
    or num_pairs where padding), block_expert [R / block_m] (the local expert of each row block in use; the blocks
    past total are not read) and total [1] (the padded rows in use). R = num_pairs + min(num_pairs, experts) *
    (block_m - 1) rounded up to block_m: the most the padding can need, known from the shapes alone. Up to
    ONE_LAUNCH_PAIRS pairs a program per expert does it all in one launch; more take three kernels: count the pairs
    per expert, lay out the experts' runs, scatter each pair to its expert's next row (the order within an expert's
    run does not matter: the GEMM's rows are independent).
    """
    flat = ids.flatten()
    num_pairs = flat.numel()
    rows = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    block_e = _pow2_block(num_experts)
    if 0 < num_pairs <= ONE_LAUNCH_PAIRS:
        sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
        total = torch.empty(1, dtype=torch.int32, device=ids.device)
        _grouping_kernels()[3][(num_experts,)](
            flat, sorted_ids, block_expert, total, num_pairs, expert_offset, num_experts, rows, block_m,
            _pow2_block(num_pairs), block_e, 64, num_warps=4, **pdl_args(ids.device),
        )  # fmt: skip
        return sorted_ids, block_expert, total
    count_kernel, layout_kernel, scatter_kernel, _ = _grouping_kernels()
    scratch = torch.zeros(2 * num_experts + 1, dtype=torch.int32, device=ids.device)
    counts, cursor, total = scratch[:num_experts], scratch[num_experts:-1], scratch[-1:]
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=ids.device)
    chunk = 1024
    grid = (-(-num_pairs // chunk),)
    count_kernel[grid](flat, counts, num_pairs, expert_offset, num_experts, chunk)
    layout_kernel[(1,)](counts, cursor, block_expert, total, num_experts, rows // block_m, block_m, block_e, 64)
    scatter_kernel[grid](flat, cursor, sorted_ids, num_pairs, expert_offset, num_experts, chunk)
    return sorted_ids, block_expert, total


def block_config(tokens: int, top_k: int, num_experts: int) -> dict[str, int]:
    """GEMM tiles by the expected rows per expert: decode's few rows read each expert's weights once."""
    # Measured on an H200 for Qwen3-30B-A3B's experts (128 x 768, top-8): 64 tokens (4 rows an expert) fastest
    # at BLOCK_M 16, 256 tokens (16) at 32 (0.31 ms the layer's two GEMMs vs 0.33 at 16), 16k tokens at 128 x 256;
    # of the tilings of tools/device/moe_tile_sweep.py none is 1.02x faster than these but the 32-row blocks' with
    # three stages instead of four: the gated gate-up GEMM 1.03-1.04x at 140-256 tokens (196.4 against 201.8 us at
    # 256), the down GEMM within 1%.
    per_expert = tokens * top_k / num_experts
    if per_expert <= 8:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if per_expert <= 192:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def gated_config(config: dict[str, int], expert_parallel: bool) -> dict[str, int] | None:
    """The gate-up GEMM's tiles with SiLU-and-mul in its epilogue (half the columns a program, each with a gate and
    an up sum), or None where the GEMM and then a SiLU-and-mul kernel measured faster.

    Qwen3-30B-A3B's experts on an H200 (tools/device/moe_grouped_bench.py): in the epilogue at row blocks up to 64
    (decode and small prefills: 196 against 199 us at 236 tokens, 226 against 242 at 1,024); apart with the prefill
    tiles (128-row blocks: 1,510 against 1,546-1,691 us at 16k tokens, the two accumulators crowd the registers).
    Under expert parallelism always in the epilogue: the rows of other ranks' pairs are never written, and a SiLU-and-
    mul over every row would read them."""
    if config["BLOCK_M"] > 64 and not expert_parallel:
        return None
    return dict(config, BLOCK_N=max(64, config["BLOCK_N"] // 2))


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    grouping: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    mul_weight: bool,
    config: dict[str, int],
    b_scale: torch.Tensor | None = None,
    gated: bool = False,
) -> None:
    """out[pair] = a[pair // a_row_div] @ b[expert]^T over the grouping's pairs (gated: SiLU-and-mul of the gate and
    up halves of b's rows, out half b's rows wide; mul_weight: scaled by the pair's routing weight)."""
    import triton  # lazy: triton is GPU-only

    sorted_ids, block_expert, total = grouping
    n, k = b.shape[1] // (2 if gated else 1), b.shape[2]
    grid = (triton.cdiv(sorted_ids.numel(), config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    scaled = b_scale is not None
    _gemm_kernel()[grid](
        a, b, out, weights, sorted_ids, block_expert, total, b_scale if scaled else weights, n, k, out.shape[0],
        sorted_ids.numel(), a.stride(0), b.stride(0), b.stride(1), out.stride(0), b_scale.stride(0) if scaled else 0,
        a_row_div, mul_weight, scaled, gated, "ieee" if a.dtype == torch.float32 else "tf32", **config,
        **pdl_args(a.device),
    )  # fmt: skip


def _pow2_block(n: int) -> int:
    """A Triton block covering n: the least power of two >= n, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def _row_block(width: int) -> int:
    """The columns one program of a row-wise pass takes: the row's width up to 1024, a power of two."""
    return min(1024, _pow2_block(width))


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    expert_offset: int = 0,
) -> torch.Tensor:
    """sum_k w[t, k] * down[e] @ silu_and_mul(gate_up[e] @ x[t]) over the top_k experts e of each token t.

    x [T, H] (contiguous), router_logits [T, E], gate_up [E_local, 2I, H], down [E_local, H, I] holding the experts
    [expert_offset, expert_offset + E_local) of the E (all of them unless expert parallelism splits them): the
    pairs routed to other experts add nothing. Returns [T, H] in x's dtype. FP8 experts (e4m3 gate_up and down)
    come with scales: (gate_up's [E_local, 2I], down's [E_local, H]) float32, one per output channel.
    out: where to write the result (distributed.partial_out's buffer, which the next norm all-reduces in place).
    """
    tokens, hidden = x.shape
    num_local, inter = gate_up.shape[0], down.shape[2]
    if moe_gemv.ENABLED and moe_gemv.usable(x, num_local, router_logits.shape[1], scales is not None):
        return moe_gemv.moe_gemv(x, router_logits, gate_up, down, top_k, renormalize, out)  # one token: two kernels
    weights, ids = route_topk(router_logits, top_k, renormalize)
    if tokens == 0:
        return torch.zeros_like(x) if out is None else out.zero_()
    config = block_config(tokens, top_k, router_logits.shape[1])  # rows per expert over all E: the same per rank
    grouping = align_by_expert(ids, num_local, config["BLOCK_M"], expert_offset)
    pairs = tokens * top_k
    expert_parallel = num_local < router_logits.shape[1]  # the other ranks' pairs' rows are never written
    gated, scale = gated_config(config, expert_parallel), None if scales is None else scales[0]
    if gated is not None:
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, gate_up, act, weights, grouping, top_k, False, gated, scale, True)
    else:
        gate_up_out = torch.empty(pairs, 2 * inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, gate_up, gate_up_out, weights, grouping, top_k, False, config, scale)
        act = SiluAndMul()(gate_up_out)
    down_out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, down_out, weights, grouping, 1, True, config, None if scales is None else scales[1])
    return topk_sum(down_out, ids, expert_offset, num_local, out)


def topk_sum(
    down_out: torch.Tensor, ids: torch.Tensor, expert_offset: int, num_local: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = the sum of token t's rows of down_out [T * top_k, H] whose expert is local, in float32, rounded
    once, by `_combine_kernel` (a program per token and 1,024 columns): Qwen3-30B-A3B's shape on an H200, 2.8 us
    at 236 tokens and 138 at 16,384 against torch.sum's 4.3 and 193 (tools/device/moe_grouped_bench.py)."""
    tokens, top_k = ids.shape
    hidden = down_out.shape[1]
    out = torch.empty(tokens, hidden, dtype=down_out.dtype, device=down_out.device) if out is None else out
    block_h = _row_block(hidden)
    _combine_kernel()[(tokens, -(-hidden // block_h))](
        down_out, ids, out, hidden, expert_offset, num_local, out.stride(0), top_k, block_h, **pdl_args(out.device)
    )
    return out
